"""A whole service run in-process on the memory broker: what a user's own tests do."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import text

from consumerdedup import App, Outbox
from consumerdedup.headers import REASON_HEADER
from consumerdedup.testing import MemoryBroker
from tests.conftest import Database
from tests.contracts.harness import until


class Payment(BaseModel):
    account: str
    amount: int


@dataclass
class PaymentData:
    account: str
    amount: int


@dataclass
class Order:
    order_id: str
    total: int


def service(db: Database) -> tuple[App, str]:
    """A payments queue (typed pydantic bodies) whose handler adds an order event to the
    outbox; the relay publishes it to "orders", read by a bulk consumer (dataclasses)."""
    ledger = db.name("ledger")
    with db.engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {ledger} (source TEXT, ref TEXT, amount INTEGER)"))
    app = App("shop", engine=db.engine, tables=db.tables)
    outbox = Outbox(db.tables)

    @app.rabbitmq(queue="payments", consumer="payments", retry_delay=timedelta(0))
    def take_payment(payment: Payment, session: Any) -> None:
        session.execute(
            text(f"INSERT INTO {ledger} VALUES ('payment', :a, :n)"),
            {"a": payment.account, "n": payment.amount},
        )
        order = {"order_id": f"o-{payment.account}", "total": payment.amount}
        outbox.add(session, "orders", json.dumps(order).encode())

    @app.kafka(topics="orders", consumer="orders", bulk=True, batch_size=10)
    def record_orders(orders: list[Order], session: Any) -> None:
        for order in orders:
            session.execute(
                text(f"INSERT INTO {ledger} VALUES ('order', :o, :t)"),
                {"o": order.order_id, "t": order.total},
            )

    app.relay(to="kafka")
    return app, ledger


def rows(db: Database, sql: str) -> list[tuple[Any, ...]]:
    with db.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(sql))]


def test_the_whole_service_runs_on_the_memory_broker(db: Database) -> None:
    app, ledger = service(db)
    broker = MemoryBroker()
    broker.publish("payments", b'{"account": "a", "amount": 5}', message_id="p-1")
    broker.publish("payments", b'{"account": "b", "amount": 7}', message_id="p-2")
    broker.publish("payments", b'{"account": "a", "amount": 5}', message_id="p-1")  # twin
    app.run(memory_broker=broker, until_idle=True)
    assert sorted(rows(db, f"SELECT source, ref, amount FROM {ledger}")) == [
        ("order", "o-a", 5),
        ("order", "o-b", 7),
        ("payment", "a", 5),
        ("payment", "b", 7),
    ]
    events = db.name("processed_events")
    assert sorted(rows(db, f"SELECT consumer, outcome FROM {events}")) == [
        ("orders", "processed"),
        ("orders", "processed"),
        ("payments", "processed"),
        ("payments", "processed"),
    ]
    assert broker.held("payments") == 0 and broker.held("orders") == 0


def test_a_body_that_does_not_validate_is_dead_lettered_and_the_next_goes_on(
    db: Database,
) -> None:
    app, ledger = service(db)
    broker = MemoryBroker()
    secret_value = "4111-1111-1111-1111"
    broker.publish("payments", json.dumps({"account": secret_value}).encode(), message_id="p-1")
    broker.publish("payments", b'{"account": "b", "amount": 7}', message_id="p-2")
    app.run(memory_broker=broker, until_idle=True, only=["payments"])
    assert rows(db, f"SELECT source, ref FROM {ledger}") == [("payment", "b")]
    [dead] = broker.messages("payments.dlq")
    reason = dead.headers[REASON_HEADER]
    assert dead.id == "p-1"
    assert "InvalidBody" in reason and "amount: Field required" in reason
    assert secret_value not in reason  # the values given are never quoted
    events = db.name("processed_events")
    assert sorted(rows(db, f"SELECT message_id, outcome FROM {events}")) == [
        ("p-1", "failed"),
        ("p-2", "processed"),
    ]


def test_a_bulk_batch_with_one_invalid_body_fails_it_alone(db: Database) -> None:
    app, ledger = service(db)
    broker = MemoryBroker()
    broker.publish("orders", b'{"order_id": "o-1", "total": 1}', message_id="e-1")
    broker.publish("orders", b'{"order_id": "o-2", "total": "lots"}', message_id="e-2")
    broker.publish("orders", b'{"order_id": "o-3", "total": 3}', message_id="e-3")
    app.run(memory_broker=broker, until_idle=True, only=["orders"])
    assert sorted(rows(db, f"SELECT ref FROM {ledger}")) == [("o-1",), ("o-3",)]
    [dead] = broker.messages("orders.dlq")
    assert (
        dead.id == "e-2" and "total: Input should be a valid integer" in dead.headers[REASON_HEADER]
    )


@pytest.mark.parametrize("kind", ["pydantic", "dataclass"])
def test_an_async_handler_gets_typed_bodies_too(db: Database, kind: str) -> None:
    ledger = db.name("seen")
    with db.engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {ledger} (amount INTEGER)"))
    app = App("svc", database_url=db.url, tables=db.tables)

    async def handle(payment: Payment, session: Any) -> None:
        await session.execute(text(f"INSERT INTO {ledger} VALUES (:n)"), {"n": payment.amount})

    async def handle_data(payment: PaymentData, session: Any) -> None:
        await session.execute(text(f"INSERT INTO {ledger} VALUES (:n)"), {"n": payment.amount})

    app.rabbitmq(queue="q", consumer="c")(handle if kind == "pydantic" else handle_data)
    broker = MemoryBroker()
    broker.publish("q", b'{"account": "a", "amount": 3}', message_id="m-1")
    app.run(memory_broker=broker, until_idle=True)
    assert rows(db, f"SELECT amount FROM {ledger}") == [(3,)]


def payments_seen(db: Database, ledger: str) -> int:
    return len(rows(db, f"SELECT ref FROM {ledger} WHERE source = 'payment'"))


def test_run_until_stopped_from_another_thread(db: Database) -> None:
    app, ledger = service(db)
    broker = MemoryBroker()
    running = threading.Thread(target=app.run, kwargs={"memory_broker": broker})
    running.start()
    try:
        broker.publish("payments", b'{"account": "a", "amount": 5}', message_id="p-1")
        assert until(lambda: payments_seen(db, ledger) == 1)
    finally:
        app.stop()
        running.join(30)
    assert not running.is_alive()


def test_sigterm_stops_run_on_the_main_thread_and_its_handler_is_given_back(
    db: Database,
) -> None:
    app, ledger = service(db)
    broker = MemoryBroker()
    broker.publish("payments", b'{"account": "a", "amount": 5}', message_id="p-1")
    before = signal.getsignal(signal.SIGTERM)

    def terminate_when_done() -> None:
        if until(lambda: payments_seen(db, ledger) == 1):
            os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=terminate_when_done)
    killer.start()
    app.run(memory_broker=broker)  # returns on SIGTERM
    killer.join(30)
    assert payments_seen(db, ledger) == 1 and broker.held("payments") == 0
    assert signal.getsignal(signal.SIGTERM) is before


async def test_run_async_is_stopped_by_cancelling_it(db: Database) -> None:
    app, ledger = service(db)
    broker = MemoryBroker()
    broker.publish("payments", b'{"account": "a", "amount": 5}', message_id="p-1")
    task = asyncio.create_task(app.run_async(memory_broker=broker))
    deadline = time.monotonic() + 30
    while payments_seen(db, ledger) < 1 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert payments_seen(db, ledger) == 1 and broker.held("payments") == 0


def test_a_consumer_of_several_topics_reads_each_on_the_memory_broker(db: Database) -> None:
    seen = db.name("seen")
    with db.engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {seen} (source TEXT, id TEXT)"))
    app = App("svc", engine=db.engine, tables=db.tables)

    @app.kafka(topics=["orders", "returns"], consumer="books", batch_size=5)
    def book(message: Any, session: Any) -> None:
        session.execute(
            text(f"INSERT INTO {seen} VALUES (:s, :i)"), {"s": message.source, "i": message.id}
        )

    broker = MemoryBroker()
    broker.publish("orders", b"{}", message_id="o-1")
    broker.publish("returns", b"{}", message_id="r-1")
    broker.publish("returns", b"{}", message_id="r-1")  # a twin
    app.run(memory_broker=broker, until_idle=True)
    assert sorted(rows(db, f"SELECT source, id FROM {seen}")) == [
        ("orders", "o-1"),
        ("returns", "r-1"),
    ]
