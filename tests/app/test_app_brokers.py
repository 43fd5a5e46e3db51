"""A service of three parts (a RabbitMQ consumer, a Kafka bulk consumer, the relay) run
in-process by App.run() against the real PostgreSQL, RabbitMQ and a Kafka-protocol broker;
and App.check() on what it declares."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import text

from consumerdedup import App, Outbox
from consumerdedup.app import Settings
from consumerdedup.startup import FAIL, OK
from tests.conftest import Database
from tests.contracts.harness import until
from tests.support.kafka_service import KafkaService, Topics, kafka_fixture  # noqa: F401
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401

PAYMENTS = 20


class Payment(BaseModel):
    account: str
    amount: int


class Order(BaseModel):
    order_id: str
    total: int


class Shop:
    """The service under test: its app, its table, and where its messages go."""

    def __init__(self, pg: Database, rabbit: Broker, kafka: KafkaService, topic: str) -> None:
        self.pg, self.rabbit, self.kafka = pg, rabbit, kafka
        self.queue = rabbit.queue("payments")
        self.topic = topic
        self.ledger = pg.name("ledger")
        with pg.engine.begin() as conn:
            conn.execute(text(f"CREATE TABLE {self.ledger} (source TEXT, ref TEXT, amount INT)"))
        suffix = uuid.uuid4().hex[:8]
        self.payments, self.orders = f"payments-{suffix}", f"orders-{suffix}"
        self.app = app = App("shop", database_url=pg.url, tables=pg.tables)
        outbox, ledger = Outbox(pg.tables), self.ledger

        @app.rabbitmq(queue=self.queue, consumer=self.payments, batch_size=10, prefetch=20)
        def take_payment(payment: Payment, session: Any) -> None:
            session.execute(
                text(f"INSERT INTO {ledger} VALUES ('payment', :a, :n)"),
                {"a": payment.account, "n": payment.amount},
            )
            order = {"order_id": f"o-{payment.account}", "total": payment.amount}
            outbox.add(session, topic, json.dumps(order).encode(), key=payment.account)

        @app.kafka(
            topics=topic,
            consumer=self.orders,
            bulk=True,
            group_id=self.orders,
            config=kafka.config(batch_size=50, poll_timeout=timedelta(milliseconds=100)),
        )
        def record_orders(orders: list[Order], session: Any) -> None:
            for order in orders:
                session.execute(
                    text(f"INSERT INTO {ledger} VALUES ('order', :o, :t)"),
                    {"o": order.order_id, "t": order.total},
                )

        app.relay(
            to="kafka",
            poll_interval=timedelta(milliseconds=100),
            publisher_options={"enable_idempotence": kafka.idempotence},
        )
        self.settings = Settings.load(
            rabbitmq_url=rabbit.url, kafka_bootstrap_servers=kafka.bootstrap
        )

    def rows(self, sql: str) -> list[tuple[Any, ...]]:
        with self.pg.engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(sql))]

    def count(self, source: str) -> int:
        return len(self.rows(f"SELECT ref FROM {self.ledger} WHERE source = '{source}'"))


@pytest.fixture
def shop(pg: Database, rabbit: Broker, kafka: KafkaService) -> Iterator[Shop]:
    topics = Topics(kafka)
    loop = asyncio.new_event_loop()
    try:
        topic = loop.run_until_complete(topics.create("orders"))
        yield Shop(pg, rabbit, kafka, topic)
    finally:
        loop.run_until_complete(topics.close())
        loop.close()


def test_three_parts_run_in_process_and_decide_each_message_once(shop: Shop) -> None:
    for i in range(PAYMENTS):
        body = json.dumps({"account": f"a{i:02d}", "amount": i}).encode()
        shop.rabbit.publish(shop.queue, body, message_id=f"p-{i}")
        if i % 4 == 0:  # a redelivery the broker's producer made
            shop.rabbit.publish(shop.queue, body, message_id=f"p-{i}")
    running = threading.Thread(target=shop.app.run, kwargs={"settings": shop.settings})
    running.start()
    try:
        assert until(lambda: shop.count("order") >= PAYMENTS, 120), shop.count("order")
    finally:
        shop.app.stop()
        running.join(60)
    assert not running.is_alive()
    accounts = [f"a{i:02d}" for i in range(PAYMENTS)]
    assert (
        sorted(r[0] for r in shop.rows(f"SELECT ref FROM {shop.ledger} WHERE source = 'payment'"))
        == accounts
    )
    assert sorted(
        r[0] for r in shop.rows(f"SELECT ref FROM {shop.ledger} WHERE source = 'order'")
    ) == [f"o-{a}" for a in accounts]
    events = shop.pg.name("processed_events")
    decided = shop.rows(f"SELECT consumer, outcome, count(*) FROM {events} GROUP BY 1, 2")
    assert sorted(decided) == sorted(
        [(shop.payments, "processed", PAYMENTS), (shop.orders, "processed", PAYMENTS)]
    )
    assert shop.rabbit.held(shop.queue) == 0


def test_check_lists_what_the_app_declares(shop: Shop) -> None:
    found = {c.name: c for c in shop.app.check(shop.settings)}
    assert all(c.status != FAIL for c in found.values()), found
    assert found[f"consumer {shop.payments}"].status == OK
    assert shop.queue in found[f"consumer {shop.payments}"].detail
    assert f"{shop.topic}.dlq" in found[f"consumer {shop.orders}"].detail
    assert found["relay relay"].status == OK


def test_check_fails_on_a_missing_topic_and_a_missing_table(shop: Shop) -> None:
    app = App("broken", database_url=shop.pg.url, tables=shop.pg.tables)
    app.kafka(topics=f"absent-{uuid.uuid4().hex[:8]}", consumer="c")(lambda m, s: None)
    found = {c.name: c for c in app.check(shop.settings)}
    assert found["consumer c"].status == FAIL and "missing topic(s)" in found["consumer c"].detail
    assert found["tables"].status == OK
    with shop.pg.engine.begin() as conn:
        conn.execute(text(f"DROP TABLE {shop.pg.tables.processed_events.fullname}"))
    found = {c.name: c for c in app.check(shop.settings)}
    assert found["tables"].status == FAIL and "init-db" in found["tables"].fix


def test_the_pruners_windows_come_from_the_brokers(shop: Shop) -> None:
    """The RabbitMQ queue's message TTL is its consumer's window; Tansu reports no
    retention.ms, so the Kafka consumer takes the retention given; one given explicitly
    shorter than its broker's is a FAIL."""
    ttl_queue = shop.rabbit.name("ttl")
    shop.rabbit.channel.queue_declare(
        ttl_queue, durable=True, arguments={"x-message-ttl": 3_600_000}
    )
    app = shop.app
    app.rabbitmq(queue=ttl_queue, consumer="ttl-consumer")(lambda m, s: None)
    app.pruner(every=timedelta(hours=1), retention=timedelta(days=3))
    found = {c.name: c for c in app.check(shop.settings, only=["pruner"])}
    assert found["window ttl-consumer"].status == OK
    assert (
        "1h" in found["window ttl-consumer"].detail
        and "rabbitmq" in found["window ttl-consumer"].detail
    )
    if shop.kafka.kind == "tansu":
        assert "3d (pruner(retention=...))" in found[f"window {shop.orders}"].detail
    [pruner] = app.build(shop.settings, only=["pruner"])
    config = pruner.pruner().config  # type: ignore[attr-defined]
    assert set(config.consumers) == {shop.payments, shop.orders, "ttl-consumer"}

    strict = App("strict", database_url=shop.pg.url, tables=shop.pg.tables)
    strict.rabbitmq(queue=ttl_queue, consumer="ttl-consumer")(lambda m, s: None)
    strict.pruner(every=timedelta(hours=1), windows={"ttl-consumer": timedelta(minutes=30)})
    [window] = [c for c in strict.check(shop.settings) if c.name == "window ttl-consumer"]
    assert window.status == FAIL and "a redelivery could find its record pruned" in window.detail
