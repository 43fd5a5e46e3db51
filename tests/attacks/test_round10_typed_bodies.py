"""Round 10, fresh eyes on issue 32's typed bodies: a model that cannot validate anything is
the deploy's fault (Invariant 8), never the messages'.

Seen failing before the fix: a body model naming a type its module never defines (a lost
import) was accepted; pydantic raised "not fully defined" at every message, inside the
handler's call, so every message was retried, recorded FAILED and dead-lettered (the
breaker stopped it only after ``breaker_threshold`` of them). A model pydantic has no
schema for (a field of an arbitrary class) raised pydantic's own error out of the
decorator instead of a ConfigurationError naming the handler.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import text

from consumerdedup import App, ConfigurationError
from consumerdedup.app import Settings
from consumerdedup.testing import MemoryBroker
from tests.conftest import Database
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401
from tests.support.run_command import Run

MESSAGES = 3


class Later(BaseModel):
    account: Account  # defined below, in this module: found when the app is built
    amount: int


class Account(BaseModel):
    name: str


class Lost(BaseModel):
    account: Missing  # type: ignore[name-defined]  # noqa: F821 - never defined


@dataclasses.dataclass
class Locked:
    lock: threading.Lock


def _records(db: Database) -> int:
    with db.engine.connect() as conn:
        sql = f"SELECT count(*) FROM {db.name('processed_events')}"
        return int(conn.execute(text(sql)).scalar_one())


def test_a_model_pydantic_has_no_schema_for_is_refused_at_declaration() -> None:
    app = App("shop")

    def take(body: Locked, session: Any) -> None:
        pass

    with pytest.raises(ConfigurationError) as refused:
        app.rabbitmq(queue="payments", consumer="payments")(take)
    assert "take" in str(refused.value) and "Locked" in str(refused.value)


def test_a_model_whose_type_is_defined_below_the_handler_works(sqlite_db: Database) -> None:
    app = App("shop", engine=sqlite_db.engine, tables=sqlite_db.tables)
    seen: list[Any] = []

    @app.rabbitmq(queue="payments", consumer="payments")
    def take(body: Later, session: Any) -> None:
        seen.append(body)

    broker = MemoryBroker()
    broker.publish("payments", b'{"account": {"name": "alice"}, "amount": 5}', message_id="p-1")
    app.run(settings=Settings.load(), memory_broker=broker, until_idle=True)
    assert seen == [Later(account=Account(name="alice"), amount=5)]


def test_a_model_never_fully_defined_stops_the_app_and_fails_no_message(
    sqlite_db: Database,
) -> None:
    app = App("shop", engine=sqlite_db.engine, tables=sqlite_db.tables)

    @app.rabbitmq(queue="payments", consumer="payments")
    def take(body: Lost, session: Any) -> None:
        pass

    broker = MemoryBroker()
    for n in range(MESSAGES):
        broker.publish("payments", b'{"account": {}}', message_id=f"p-{n}")
    with pytest.raises(ConfigurationError) as refused:
        app.run(settings=Settings.load(), memory_broker=broker, until_idle=True)
    assert "Lost is not fully defined" in str(refused.value) and "Missing" in str(refused.value)
    assert _records(sqlite_db) == 0
    assert broker.messages("payments.dlq") == []
    assert broker.held("payments") == MESSAGES
    with pytest.raises(ConfigurationError, match="not fully defined"):
        app.check(Settings.load())


def test_under_the_worker_it_is_a_setup_fault_and_the_queue_keeps_its_messages(
    pg: Database, rabbit: Broker
) -> None:
    queue = rabbit.queue("typed")
    for n in range(MESSAGES):
        rabbit.publish(queue, b'{"account": {}, "amount": 1}', message_id=f"pay-{n}")
    run = Run(
        ["tests.attacks.round10_typed_service:app"],
        {
            "CONSUMERDEDUP_DATABASE_URL": pg.url,
            "CONSUMERDEDUP_RABBITMQ_URL": rabbit.url,
            "ROUND10_SCHEMA": str(pg.schema),
            "ROUND10_QUEUE": queue,
        },
    )
    try:
        deadline = time.monotonic() + 90  # until it stops, or a message was recorded
        while run.process.poll() is None and _records(pg) == 0:
            assert time.monotonic() < deadline, f"neither stopped nor recorded:\n{run.stderr}"
            time.sleep(0.05)
        code = run.wait(60)
        assert _records(pg) == 0, run.stderr  # no message charged with the deploy's fault
        assert code == 1, run.stderr
        last = run.stderr.strip().splitlines()[-1]
        assert "Payment is not fully defined" in last and "Account" in last, run.stderr
        assert "restarting" not in run.stderr
        assert rabbit.held(queue) == MESSAGES
        assert rabbit.held(queue + ".dlq") == 0
    finally:
        run.stop()
