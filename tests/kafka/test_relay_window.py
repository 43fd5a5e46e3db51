"""The pipelined relay on Kafka (Tansu): a send that fails in the middle of a window.

A real refusal from the client library (aiokafka refuses a record over
``max_request_size`` before sending it) and one the broker would answer after the
window's later records were already sent (a producer double failing one record's future
with aiokafka's InvalidTimestampError; Tansu enforces no record policy). Each time, no
later event of the failed key is marked in that round, the other keys' events are, and
once the broker takes everything every event is on the topic. Order: what was refused
before it left holds its key's later events back; what was refused in flight is sent
again from the refused event, so each event's last copy is in key order (consumers
dedup the earlier copies by event_id).
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any, ClassVar

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import InvalidTimestampError
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from consumerdedup import Outbox, OutboxRelay, RelayConfig
from consumerdedup.adapters.kafka import KafkaPublisher
from consumerdedup.headers import ID_HEADER
from tests.support.kafka_service import KafkaService, Topics, kafka_fixture, topics_fixture  # noqa: F401

NOW = RelayConfig(batch_size=100, initial_backoff=timedelta(0), max_backoff=timedelta(0))


def add(db: Any, topic: str, bodies: dict[str, bytes]) -> None:
    """Events of keys a, b, c with seqs 1..5, interleaved; ``bodies`` replaces a body."""
    outbox = Outbox(db.tables)
    with Session(db.engine) as session, session.begin():
        for seq in range(1, 6):
            for key in "abc":
                name = f"{key}{seq}"
                outbox.add(session, topic, bodies.get(name, name.encode()), key=key)


def published(db: Any) -> set[str]:
    ob = db.tables.outbox
    with db.engine.connect() as conn:
        rows = conn.execute(select(ob.c.body).where(ob.c.published_at.is_not(None)))
        return {row.body.decode()[:2] for row in rows}


def last_copies(records: list[Any]) -> dict[str, list[str]]:
    """Per key, the bodies in topic order, each event kept at its last copy."""
    last: dict[str, int] = {}
    for n, record in enumerate(records):
        last[dict(record.headers)[ID_HEADER].decode()] = n
    per_key: dict[str, list[str]] = {}
    for n, record in enumerate(records):
        if last[dict(record.headers)[ID_HEADER].decode()] == n:
            per_key.setdefault(record.key.decode(), []).append(record.value.decode()[:2])
    return per_key


EVERY = {key: [f"{key}{seq}" for seq in range(1, 6)] for key in "abc"}


async def test_a_record_refused_before_it_left_holds_back_its_key_in_the_window(
    kafka: KafkaService, topics: Topics, pg: Any
) -> None:
    topic = await topics.create("window", partitions=2)
    add(pg, topic, {"a3": b"a3" + b"x" * 8000})  # over max_request_size below
    publisher = KafkaPublisher(
        kafka.bootstrap, enable_idempotence=kafka.idempotence, options={"max_request_size": 4096}
    )

    def rounds() -> tuple[set[str], int]:
        with OutboxRelay(pg.engine, publisher, tables=pg.tables, config=NOW) as relay:
            relay.run_once()
            first = published(pg)
            ob = pg.tables.outbox
            with pg.engine.begin() as conn:  # the producer of a3 fixes it
                conn.execute(update(ob).where(func.length(ob.c.body) > 100).values(body=b"a3"))
            return first, relay.drain()

    first, rest = await asyncio.to_thread(rounds)
    assert first == {"a1", "a2"} | {f"{k}{s}" for k in "bc" for s in range(1, 6)}
    assert rest == 3
    records = await topics.records(topic)
    assert len(records) == 15  # nothing of key a after a3 left in the first round
    assert last_copies(records) == EVERY


class FailsInFlight(AIOKafkaProducer):  # type: ignore[misc]
    """Sends everything for real but a3, the first time: its future fails as the broker
    would answer it, while the later records of the window go out."""

    failed: ClassVar[list[bytes]] = []

    async def send(self, topic: str, value: bytes, *args: Any, **kwargs: Any) -> Any:
        if value == b"a3" and not self.failed:
            self.failed.append(value)
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            future.set_exception(InvalidTimestampError())
            return future
        return await super().send(topic, value, *args, **kwargs)


async def test_a_record_refused_in_flight_is_sent_again_with_its_keys_later_events(
    kafka: KafkaService, topics: Topics, pg: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(FailsInFlight, "failed", [])
    monkeypatch.setattr("consumerdedup.adapters.kafka.connection.AIOKafkaProducer", FailsInFlight)
    topic = await topics.create("inflight", partitions=2)
    add(pg, topic, {})
    publisher = KafkaPublisher(kafka.bootstrap, enable_idempotence=kafka.idempotence)

    def rounds() -> tuple[set[str], int]:
        with OutboxRelay(pg.engine, publisher, tables=pg.tables, config=NOW) as relay:
            relay.run_once()
            return published(pg), relay.drain()

    first, rest = await asyncio.to_thread(rounds)
    assert first == {"a1", "a2"} | {f"{k}{s}" for k in "bc" for s in range(1, 6)}
    assert rest == 3
    ob = pg.tables.outbox
    with pg.engine.connect() as conn:
        charged = conn.execute(select(ob.c.body, ob.c.attempts).where(ob.c.attempts > 0)).all()
    assert [(row.body, row.attempts) for row in charged] == [(b"a3", 1)]
    records = await topics.records(topic)
    values = [record.value for record in records]
    assert values.count(b"a4") == 2 and values.count(b"a5") == 2  # on the broker already
    assert last_copies(records) == EVERY
