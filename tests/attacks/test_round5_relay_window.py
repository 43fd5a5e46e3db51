"""Round 5: the pipelined relay (a window sent, then its confirms awaited together) against
events the publisher cannot even encode, on the real RabbitMQ and PostgreSQL.

A stored row may hold what PostgreSQL's json column takes and no broker client encodes
(a header value with a lone surrogate, written by hand: ``Outbox.add`` refuses it now),
or a key of 200 characters that is more than AMQP's 255 bytes of routing key.
Such an event must fail alone (its key held back, an attempt charged to it only); the
window's other keys go in the same round."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from consumerdedup import Outbox, OutboxRelay, RelayConfig
from consumerdedup.adapters.kafka import KafkaPublisher
from consumerdedup.adapters.rabbitmq import RabbitPublisher
from tests.rabbitmq.test_relay_window import first_copies, published
from tests.support.kafka_service import KafkaService, Topics, kafka_fixture, topics_fixture  # noqa: F401
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401

NOW = RelayConfig(batch_size=100, initial_backoff=timedelta(0), max_backoff=timedelta(0))


def _poison_headers(db: Any, body: bytes) -> None:
    """Give a stored event a header with a lone surrogate, as a hand-written row (or an older
    release) could: PostgreSQL's json column takes it; no broker client can encode it."""
    ob = db.tables.outbox
    with db.engine.begin() as conn:
        headers = conn.execute(select(ob.c.headers).where(ob.c.body == body)).scalar_one()
        headers = {**headers, "h": "x\udc00"}
        conn.execute(update(ob).where(ob.c.body == body).values(headers=headers))


def _charged(db: Any) -> dict[str, int]:
    ob = db.tables.outbox
    with db.engine.connect() as conn:
        rows = conn.execute(select(ob.c.body, ob.c.attempts).where(ob.c.attempts > 0))
        return {row.body.decode(): row.attempts for row in rows}


def test_an_event_the_publisher_cannot_encode_fails_alone_in_its_window(
    pg: Any, rabbit: Broker
) -> None:
    from sqlalchemy.orm import Session

    from consumerdedup import Outbox

    main = rabbit.queue("main", dead_letter=False)
    long_key = "\u00e9" * 200  # 200 characters, 400 bytes: past AMQP's shortstr
    outbox = Outbox(pg.tables)
    with Session(pg.engine) as session, session.begin():
        for seq in range(1, 4):
            outbox.add(session, main, f"a{seq}".encode(), key="a")
            outbox.add(session, main, f"b{seq}".encode(), key="b")
            destination = "amq.direct/" if seq == 1 else main  # c1: routing key too long
            outbox.add(session, destination, f"c{seq}".encode(), key=long_key)
    _poison_headers(pg, b"b2")  # b2: no UTF-8 for it
    with OutboxRelay(pg.engine, RabbitPublisher(rabbit.url), tables=pg.tables, config=NOW) as relay:
        relay.run_once()
        assert published(pg) == {"a1", "a2", "a3", "b1"}
        assert _charged(pg) == {"b2": 1, "c1": 1}
    assert first_copies(rabbit, main) == ["a1", "b1", "a2", "a3"]


async def test_kafka_an_event_the_publisher_cannot_encode_fails_alone_in_its_window(
    kafka: KafkaService, topics: Topics, pg: Any
) -> None:
    """The same on Kafka (KafkaPublisher, an AsyncPublisher driven from the relay's loop)."""
    topic = await topics.create("encode", partitions=1)
    outbox = Outbox(pg.tables)
    with Session(pg.engine) as session, session.begin():
        for seq in range(1, 4):
            for key in "ab":
                outbox.add(session, topic, f"{key}{seq}".encode(), key=key)
    _poison_headers(pg, b"b2")
    publisher = KafkaPublisher(kafka.bootstrap, enable_idempotence=kafka.idempotence)

    def one_round() -> tuple[set[str], dict[str, int]]:
        with OutboxRelay(pg.engine, publisher, tables=pg.tables, config=NOW) as relay:
            relay.run_once()
            return published(pg), _charged(pg)

    marked, charged = await asyncio.to_thread(one_round)
    assert marked == {"a1", "a2", "a3", "b1"}
    assert charged == {"b2": 1}
