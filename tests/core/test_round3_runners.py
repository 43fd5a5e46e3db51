"""Issue 17 item 6 through the runners: a ConfigurationError a handler raises stops nothing.

The order id of one message is an int, so ``Outbox.add`` refuses it. That message is
dead-lettered with the reason; the runner keeps going and the later messages are processed
(before the fix, ``run()`` raised on it, and every restart died on the same message).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from consumerdedup import AsyncDeduplicator, Deduplicator, Message, Outbox, RetryPolicy
from consumerdedup.adapters.rabbitmq import RabbitConfig, RabbitConsumerRunner
from consumerdedup.headers import REASON_HEADER
from consumerdedup.testing import MemoryBroker, MemoryConfig, MemoryConsumerRunner
from tests.conftest import Database
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401

FAST = RetryPolicy(attempts=2, initial_delay=timedelta(0), max_delay=timedelta(0))
ORDERS = [("m1", "o1"), ("bad", 2), ("m3", "o3"), ("m4", "o4")]


@pytest.fixture(params=["sync", "async"])
def handler(request: pytest.FixtureRequest, db: Database) -> Iterator[Any]:
    """Writes the message to the ledger and adds an outbox event keyed by its order id."""
    ledger = db.create_ledger()
    outbox = Outbox(db.tables)
    sql = text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', 1, :m)")
    if request.param == "sync":
        dedup = Deduplicator(db.engine, consumer="orders", tables=db.tables, retry=FAST)

        @dedup.handler
        def handle(message: Message, session: Any) -> None:
            session.execute(sql, {"m": message.id})
            outbox.add(session, "events", b"{}", key=json.loads(message.body)["order"])

        yield handle
        return
    engine = create_async_engine(db.async_url, poolclass=NullPool)
    async_dedup = AsyncDeduplicator(engine, consumer="orders", tables=db.tables, retry=FAST)

    @async_dedup.handler
    async def handle_async(message: Message, session: Any) -> None:
        await session.execute(sql, {"m": message.id})
        await outbox.add(session, "events", b"{}", key=json.loads(message.body)["order"])

    yield handle_async


def applied(db: Database) -> list[str]:
    with db.engine.connect() as conn:
        rows = conn.exec_driver_sql(f"SELECT message_id FROM {db.name('ledger')}")
        return sorted(r[0] for r in rows)


def check_outcome(db: Database, dead: list[tuple[str | None, str]]) -> None:
    assert applied(db) == ["m1", "m3", "m4"]
    assert [key for key, _ in dead] == ["bad"], dead
    assert "ConfigurationError" in dead[0][1] and "key must be None or a str" in dead[0][1]
    pe = db.tables.processed_events
    with db.engine.connect() as conn:
        outcomes = {r.message_id: r.outcome for r in conn.execute(pe.select())}
    assert outcomes == {"m1": "processed", "bad": "failed", "m3": "processed", "m4": "processed"}


def test_the_memory_runner_dead_letters_the_message_and_goes_on(db: Database, handler: Any) -> None:
    broker = MemoryBroker()
    for mid, order_id in ORDERS:
        broker.publish("orders", json.dumps({"order": order_id}).encode(), message_id=mid)
    config = MemoryConfig(batch_size=2, retry_delay=timedelta(0))
    MemoryConsumerRunner(handler, "orders", broker=broker, config=config).run(until_idle=True)
    dead = [(m.id, m.headers[REASON_HEADER]) for m in broker.messages("orders.dlq")]
    check_outcome(db, dead)
    assert broker.held("orders") == 0


def test_the_rabbitmq_runner_dead_letters_the_message_and_goes_on(
    db: Database, handler: Any, rabbit: Broker
) -> None:
    queue = rabbit.queue("round3")
    for mid, order_id in ORDERS:
        rabbit.publish(queue, json.dumps({"order": order_id}).encode(), message_id=mid)
    config = RabbitConfig(
        prefetch=10,
        batch_size=2,
        declare=True,
        retry_delay=timedelta(0),
        idle_timeout=timedelta(milliseconds=300),
    )
    RabbitConsumerRunner(handler, queue, url=rabbit.url, config=config).run(until_idle=True)
    dead = [(p.message_id, p.headers[REASON_HEADER]) for p, _ in rabbit.peek(queue + ".dlq")]
    check_outcome(db, dead)
    assert rabbit.held(queue) == 0
