"""One trace through the Kafka-protocol broker (Tansu) and a second hop, as through RabbitMQ."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from sqlalchemy.orm import Session

from consumerdedup import Deduplicator, Message, Outbox, OutboxRelay
from consumerdedup.adapters.kafka import KafkaConsumerRunner, KafkaPublisher
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)
from tests.telemetry.conftest import Otel, assert_two_hops

FAST = {"poll_timeout": timedelta(milliseconds=100), "retry_delay": timedelta(0)}


# About 3.5 s: two consumer groups join Tansu; the one Kafka trace the issue asks for.
async def test_one_event_through_kafka_and_a_second_hop_is_one_trace(
    sqlite_db: Any, kafka: KafkaService, topics: Topics, otel: Otel
) -> None:
    db, outbox = sqlite_db, Outbox(tables=sqlite_db.tables)
    orders, billing = await topics.create("orders"), await topics.create("billing")
    tracer = otel.tracer_provider.get_tracer("test")
    request = tracer.start_as_current_span("POST /orders")
    with request, Session(db.engine) as session, session.begin():
        outbox.add(session, orders, b'{"order": 1}')
    dedups = {name: Deduplicator(db.engine, consumer=name, tables=db.tables) for name in ("o", "b")}

    @dedups["o"].handler
    def take_order(message: Message, session: Session) -> None:
        outbox.add(session, billing, b'{"bill": 1}')

    handlers = {orders: take_order, billing: dedups["b"].handler(lambda m, s: None)}
    publisher = KafkaPublisher(kafka.bootstrap, enable_idempotence=kafka.idempotence)
    relay = OutboxRelay(db.engine, publisher, tables=db.tables)
    try:  # the relay blocks: from asyncio code in a thread, its close too
        for topic in (orders, billing):
            assert await asyncio.to_thread(relay.drain) == 1
            await KafkaConsumerRunner(
                handlers[topic], topic, bootstrap_servers=kafka.bootstrap,
                group_id="g-" + topic, config=kafka.config(**FAST),
            ).run(until_idle=True)  # fmt: skip
    finally:
        await asyncio.to_thread(relay.close)

    assert_two_hops(otel, orders, billing)
    (process,) = otel.named(f"process {orders}")
    attributes = dict(process.attributes or {})
    assert attributes["messaging.system"] == "kafka"
    assert attributes["messaging.destination.partition.id"] == "0"
    assert attributes["messaging.kafka.offset"] == 0
    assert dict(otel.named(f"send {orders}")[0].attributes or {})["messaging.system"] == "kafka"
