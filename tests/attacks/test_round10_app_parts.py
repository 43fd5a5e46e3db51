"""Round 10, fresh eyes on issue 32 and 38: the App's relay and pruner options, checked
where they are given (Invariant 10) and never ignored (Invariant 7).

Seen failing before the fixes:
- ``app.relay(publisher_options=...)`` was taken as any mapping: a misspelt keyword
  (``enable_idempotenc``) or a wrong value (``enable_idempotence="no"``) broke the relay
  only when the worker built it; the misspelling as a TypeError, a crash the supervisor
  restarted until it gave up;
- ``app.pruner(windows=...)`` naming no consumer of the app (a misspelt name) was ignored:
  its consumer was pruned by ``retention`` (or its broker's window) instead of the longer
  window given for it, so a record went while a redelivery could still come.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text

from consumerdedup import App, ConfigurationError, Deduplicator, Message, Outcome
from consumerdedup.app import Settings
from consumerdedup.testing import MemoryBroker
from tests.conftest import Database


@pytest.mark.parametrize("to", ["kafka", "rabbitmq"])
def test_a_misspelt_publisher_option_is_refused_where_given(to: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        App("shop").relay(to=to, publisher_options={"enable_idempotenc": False})
    assert "publisher_options" in str(refused.value)
    assert "'enable_idempotenc'" in str(refused.value)


def test_a_wrong_publisher_option_value_is_refused_where_given() -> None:
    with pytest.raises(ConfigurationError, match="enable_idempotence"):
        App("shop").relay(to="kafka", publisher_options={"enable_idempotence": "no"})
    with pytest.raises(ConfigurationError, match="attempts"):
        App("shop").relay(to="rabbitmq", publisher_options={"attempts": 0})
    App("shop").relay(to="kafka", publisher_options={"enable_idempotence": False})
    App("shop").relay(to="rabbitmq", publisher_options={"attempts": 5})


@pytest.mark.parametrize(("to", "address"), [("kafka", "bootstrap_servers"), ("rabbitmq", "url")])
def test_the_publishers_address_in_its_options_is_refused(to: str, address: str) -> None:
    with pytest.raises(ConfigurationError, match="CONSUMERDEDUP_"):
        App("shop").relay(to=to, publisher_options={address: "somewhere"})


def _records(db: Database, consumer: str) -> int:
    sql = f"SELECT count(*) FROM {db.name('processed_events')} WHERE consumer = :c"
    with db.engine.connect() as conn:
        return int(conn.execute(text(sql), {"c": consumer}).scalar_one())


def test_a_pruner_window_for_no_consumer_is_refused_not_ignored(sqlite_db: Database) -> None:
    db = sqlite_db
    dedup = Deduplicator(db.engine, "payments", tables=db.tables)

    @dedup.handler
    def apply(message: Message, session: Any) -> None:
        pass

    assert apply(Message(id="pay-1", body=b"{}")) is Outcome.PROCESSED
    with db.engine.begin() as conn:  # processed 20 days ago: inside its own 30-day window
        conn.execute(
            text(f"UPDATE {db.name('processed_events')} SET processed_at = :at"),
            {"at": _days_ago(20)},
        )
    app = App("shop", engine=db.engine, tables=db.tables)
    app.rabbitmq(queue="payments", consumer="payments")(apply.fn)
    app.pruner(
        every=timedelta(hours=1),
        retention=timedelta(days=7),
        windows={"paymnets": timedelta(days=30)},  # misspelt
    )
    with pytest.raises(ConfigurationError) as refused:
        app.run(
            settings=Settings.load(),
            memory_broker=MemoryBroker(),
            until_idle=True,
            only=["pruner"],
        )
    assert "'paymnets'" in str(refused.value) and "payments" in str(refused.value)
    assert _records(db, "payments") == 1  # not pruned by the 7-day retention
    with pytest.raises(ConfigurationError, match="paymnets"):
        app.check(Settings.load())


def test_a_pruner_declared_before_its_consumers_may_name_them() -> None:
    app = App("shop")
    app.pruner(every=timedelta(hours=1), windows={"payments": timedelta(days=30)})

    @app.rabbitmq(queue="payments", consumer="payments")
    def apply(message: Message, session: Any) -> None:
        pass

    parts = app.build(Settings.load(database_url="sqlite://"), memory_broker=MemoryBroker())
    assert sorted(p.name for p in parts) == ["payments", "pruner"]


def _days_ago(days: int) -> Any:
    from datetime import UTC, datetime

    return datetime.now(UTC) - timedelta(days=days)
