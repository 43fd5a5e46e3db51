"""MemoryConfig and the MemoryConsumerRunner's call form, twins of the brokers' (see also
tests/project/test_adapter_symmetry.py): validation, the RETRY backoff, the old call form."""

from __future__ import annotations

import warnings
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text

from consumerdedup import ConfigurationError, Deduplicator, Message, RetryLater, RetryPolicy
from consumerdedup.testing import MemoryBroker, MemoryConfig, MemoryConsumerRunner
from tests.conftest import Database

ONE_TRY = RetryPolicy(attempts=1, initial_delay=timedelta(0), max_delay=timedelta(0))
MS = timedelta(milliseconds=1)


class PauseRecorder(MemoryConsumerRunner):
    """Records each pause instead of waiting it out."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pauses: list[float] = []

    def pause(self, seconds: float) -> bool:
        self.pauses.append(seconds)
        return self.stopping


def ledger_handler(db: Database, refusals: dict[str, int]) -> Any:
    """Applies each message once it has been refused ``refusals[id]`` times (RetryLater)."""
    ledger = db.create_ledger()
    dedup = Deduplicator(db.engine, "ledger", tables=db.tables, retry=ONE_TRY)

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        if refusals.get(str(message.id), 0) > 0:
            refusals[str(message.id)] -= 1
            raise RetryLater("not yet")
        session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', 1, :m)"),
            {"m": message.id},
        )

    return handle


@pytest.mark.parametrize(
    "overrides",
    [
        {"batch_size": 0},
        {"batch_size": 1.5},
        {"poll_timeout": timedelta(0)},
        {"retry_delay": -MS},
        {"retry_delay": 2 * MS, "max_retry_delay": MS},
        {"connection_name": ""},
    ],
)
def test_a_bad_setting_is_refused_at_construction(overrides: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        MemoryConfig(**overrides)


def test_a_retry_waits_doubled_per_retry_in_a_row_up_to_the_max(sqlite_db: Database) -> None:
    broker = MemoryBroker()
    broker.publish("payments", b"{}", message_id="p0")
    config = MemoryConfig(retry_delay=MS, max_retry_delay=3 * MS)
    refusals = {"p0": 4}
    handle = ledger_handler(sqlite_db, refusals)
    runner = PauseRecorder(handle, "payments", broker=broker, config=config)
    runner.run(until_idle=True)
    assert runner.pauses == [0.001, 0.002, 0.003, 0.003]
    assert broker.held("payments") == 0

    refusals["p1"] = 1  # another message starts again from the first wait
    broker.publish("payments", b"{}", message_id="p1")
    runner.run(until_idle=True)
    assert runner.pauses[4:] == [0.001]


def test_the_new_call_form_does_not_warn(sqlite_db: Database) -> None:
    broker = MemoryBroker()
    broker.publish("payments", b"{}", message_id="p0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runner = MemoryConsumerRunner(ledger_handler(sqlite_db, {}), "payments", broker=broker)
    runner.run(until_idle=True)
    assert runner.config == MemoryConfig()
    assert runner.queue == "payments" and broker.held("payments") == 0


def test_the_old_call_form_still_works_with_a_deprecation_warning(sqlite_db: Database) -> None:
    broker = MemoryBroker()
    for n in range(3):
        broker.publish("payments", b"{}", message_id=f"p{n}")
    handle = ledger_handler(sqlite_db, {"p1": 2})
    with pytest.warns(DeprecationWarning, match=r"MemoryConsumerRunner\(handler, queue"):
        runner = PauseRecorder(
            broker, "payments", handle, batch_size=3, retry_delay=0.02, poll_interval=0.01, name="n"
        )
    assert runner.config == MemoryConfig(
        batch_size=3,
        poll_timeout=10 * MS,
        retry_delay=20 * MS,
        max_retry_delay=20 * MS,  # the old runner waited retry_delay each time
        connection_name="n",
    )
    assert runner.name == "n" and runner.queue == "payments"
    runner.run(until_idle=True)
    assert runner.pauses == [0.02, 0.02]
    assert broker.held("payments") == 0

    with pytest.warns(DeprecationWarning):
        by_name = MemoryConsumerRunner(broker=broker, source="payments", handler=handle)
    assert by_name.config.batch_size == 1 and by_name.config.retry_delay == 50 * MS
