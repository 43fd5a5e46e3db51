"""docs/loops.md's confluent-kafka recipes, run against the Kafka-protocol broker: the
offset is committed (``enable.auto.commit=False`` and ``commit``), or stored for the
auto-commit (``enable.auto.offset.store=False`` and ``store_offsets``), only after
process_once decided the record, so a crash between the database COMMIT and the offset
commit re-reads the record and it answers DUPLICATE."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from consumerdedup import Deduplicator, Message, Outcome
from consumerdedup.integrations.kafka_records import kafka_message
from consumerdedup.integrations.process_once import ProcessOnce, process_once
from tests.conftest import Database
from tests.support.kafka_service import (  # noqa: F401
    TANSU_GROUP_OPTIONS,
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)

confluent_kafka = pytest.importorskip("confluent_kafka")


class Crash(Exception):
    """The process dies after the COMMIT, before the offset commit."""


def consume(
    bootstrap: str,
    group: str,
    topic: str,
    once: ProcessOnce,
    wanted: int,
    before_offset_commit: Callable[[Any], None] = lambda msg: None,
    store: bool = False,
) -> list[Outcome]:
    """The recipe's loop (docs/loops.md), until ``wanted`` records are decided; ``store``:
    the store_offsets recipe (auto-commit of offsets stored only after the COMMIT)."""
    offsets: dict[str, Any] = (
        {"enable.auto.commit": True, "enable.auto.offset.store": False}
        if store
        else {"enable.auto.commit": False}  # the offset moves only after the COMMIT
    )
    consumer = confluent_kafka.Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            **offsets,
            "auto.offset.reset": "earliest",
            "session.timeout.ms": max(TANSU_GROUP_OPTIONS["session_timeout_ms"], 6000),
        }
    )
    consumer.subscribe([topic])
    decided: list[Outcome] = []
    deadline = time.monotonic() + 60
    try:
        while len(decided) < wanted:
            assert time.monotonic() < deadline, f"only {decided} of {wanted} records in 60 s"
            msg = consumer.poll(0.2)
            if msg is None or msg.error():
                continue
            result = once(kafka_message(msg))
            if not result.outcome.acks:  # RETRY: read it again, nothing behind it moves on
                consumer.seek(
                    confluent_kafka.TopicPartition(msg.topic(), msg.partition(), msg.offset())
                )
                continue
            before_offset_commit(msg)
            if store:
                consumer.store_offsets(message=msg)  # the auto-commit (or close) commits it
            else:
                consumer.commit(message=msg, asynchronous=False)
            decided.append(result.outcome)
    finally:
        consumer.close()
    return decided


@pytest.mark.parametrize("store", [False, True], ids=["commit", "store_offsets"])
async def test_crash_before_offset_commit_applies_once(
    pg: Database, kafka: KafkaService, topics: Topics, store: bool
) -> None:
    ledger = pg.create_ledger()
    dedup = Deduplicator(pg.engine, "orders-loop", tables=pg.tables)

    @dedup.handler
    def charge(message: Message, session: Session) -> None:
        session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', 1, :id)"),
            {"id": message.id},
        )

    topic = await topics.create("loop")
    for event_id in ("e-1", "e-2", "e-1"):  # the producer sent e-1 twice
        await topics.produce(topic, b"{}", event_id=event_id)
    group = f"loop-{uuid.uuid4().hex[:8]}"

    def crash(msg: Any) -> None:
        raise Crash

    with process_once(charge) as once:
        with pytest.raises(Crash):  # e-1 committed in the database, its offset not
            await asyncio.to_thread(consume, kafka.bootstrap, group, topic, once, 1, crash, store)
        outcomes = await asyncio.to_thread(
            consume, kafka.bootstrap, group, topic, once, 3, lambda msg: None, store
        )
    assert outcomes == [Outcome.DUPLICATE, Outcome.PROCESSED, Outcome.DUPLICATE]
    with pg.engine.connect() as conn:
        rows = conn.execute(text(f"SELECT message_id FROM {ledger} ORDER BY 1")).scalars()
        assert list(rows) == ["e-1", "e-2"]
    assert await topics.committed(group, topic) == {0: 3}
