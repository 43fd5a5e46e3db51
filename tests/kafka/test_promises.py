"""README promises of the Kafka adapter that no other test holds it to.

- each partition is handled in chunks of at most ``batch_size`` records, one database
  transaction per chunk (the handler asks PostgreSQL for its transaction id; the
  engine's commits are counted);
- ``run()`` raises when no broker answers at start, instead of waiting forever;
- ``KafkaPublisher`` raises BrokerUnavailable at once when nothing listens (not after
  aiokafka's 40 s request timeout), and the outbox relay then charges no attempt.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from datetime import timedelta
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError
from sqlalchemy import event, func, select, text
from sqlalchemy.orm import Session

from consumerdedup import (
    AsyncDeduplicator,
    BrokerUnavailable,
    Deduplicator,
    DestinationMissing,
    Message,
    Outbox,
    OutboxRelay,
    Outcome,
    RelayConfig,
)
from consumerdedup.adapters.kafka import KafkaConfig, KafkaConsumerRunner, KafkaPublisher
from consumerdedup.retry import ErrorKind, classify
from tests.conftest import Database
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    free_port,
    kafka_fixture,
    topics_fixture,
)

FAST = {"poll_timeout": timedelta(milliseconds=100), "retry_delay": timedelta(0)}


@pytest.mark.postgres
@pytest.mark.parametrize("batch_size", [1, 5])
async def test_each_chunk_of_a_partition_is_at_most_batch_size_records_in_one_transaction(
    kafka: KafkaService, topics: Topics, pg: Database, batch_size: int
) -> None:
    partitions, per_partition = 2, 23 if batch_size > 1 else 6
    topic = await topics.create("chunks", partitions=partitions)
    total = partitions * per_partition
    await topics.produce_many(
        topic,
        [(f"m-{i:03d}", json.dumps({"n": i}).encode()) for i in range(total)],
        partitions=partitions,
    )
    engine = pg.async_engine()
    commits = 0

    def committed(conn: Any) -> None:
        nonlocal commits
        commits += 1

    event.listen(engine.sync_engine, "commit", committed)
    seen: list[tuple[int, int, int]] = []  # (transaction id, partition, offset) per call
    dedup = AsyncDeduplicator(engine, consumer="chunks", tables=pg.tables)

    @dedup.handler
    async def handle(message: Message, session: Any) -> None:
        txid = (await session.execute(text("SELECT txid_current()"))).scalar_one()
        assert message.partition is not None and message.offset is not None
        seen.append((int(txid), message.partition, message.offset))

    runner = KafkaConsumerRunner(
        handle,
        topic,
        bootstrap_servers=kafka.bootstrap,
        group_id="group-" + topic,
        config=kafka.config(batch_size=batch_size, **FAST),
    )
    try:
        await asyncio.wait_for(runner.run(until_idle=True), 120)
    finally:
        await engine.dispose()

    assert runner.outcomes == {Outcome.PROCESSED: total}
    chunks: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for txid, partition, offset in seen:
        chunks[txid].append((partition, offset))
    assert len(seen) == total  # no handler ran twice: nothing was rolled back and redone
    for records in chunks.values():
        assert len(records) <= batch_size, records
        assert len({p for p, _ in records}) == 1, f"one chunk, two partitions: {records}"
        offsets = [o for _, o in records]
        assert offsets == list(range(offsets[0], offsets[0] + len(offsets))), records
    # One transaction per chunk: every commit on the engine was a chunk's, no other.
    assert commits == len(chunks)
    full = sum(1 for records in chunks.values() if len(records) == batch_size)
    assert full >= partitions * (per_partition // batch_size) - partitions, {
        t: len(r) for t, r in chunks.items()
    }
    count = func.count()
    with pg.engine.connect() as conn:
        recorded = conn.execute(select(count).select_from(pg.tables.processed_events)).scalar()
    assert recorded == total


async def test_run_raises_when_no_broker_answers_at_start(sqlite_db: Database) -> None:
    dedup = Deduplicator(sqlite_db.engine, consumer="nobody", tables=sqlite_db.tables)
    handle = dedup.handler(lambda message, session: None)
    runner = KafkaConsumerRunner(
        handle,
        "orders",
        bootstrap_servers=f"127.0.0.1:{free_port()}",
        config=KafkaConfig(idempotent_producer=False, **FAST),
    )
    started = time.monotonic()
    with pytest.raises(KafkaConnectionError):
        await asyncio.wait_for(runner.run(), 60)
    assert time.monotonic() - started < 30
    assert runner.consumer is None  # closed: run() can be called again under a supervisor
    with pytest.raises(KafkaConnectionError):
        await asyncio.wait_for(runner.run(), 60)


async def test_a_publisher_with_nothing_listening_is_broker_unavailable_at_once() -> None:
    publisher = KafkaPublisher(f"127.0.0.1:{free_port()}", enable_idempotence=False)
    try:
        for _ in range(2):  # the next publish tries to connect again, and says the same
            started = time.monotonic()
            with pytest.raises(BrokerUnavailable) as caught:
                await publisher.publish("orders", b"x", key="k", headers={"event_id": "e-1"})
            assert time.monotonic() - started < 10  # not after request_timeout_ms (40 s)
            assert isinstance(caught.value, ConnectionError)
            assert not isinstance(caught.value, DestinationMissing)
            assert isinstance(caught.value.__cause__, KafkaConnectionError)
            assert classify(caught.value) is ErrorKind.TRANSIENT
    finally:
        await publisher.stop()


def test_the_relay_charges_no_attempt_when_the_kafka_broker_is_away(sqlite_db: Database) -> None:
    db = sqlite_db
    with Session(db.engine) as session, session.begin():
        Outbox(db.tables).add(session, "orders", b"hello", key="k")
    publisher = KafkaPublisher(f"127.0.0.1:{free_port()}", enable_idempotence=False)
    config = RelayConfig(initial_backoff=timedelta(0), max_backoff=timedelta(0), max_attempts=1)
    with OutboxRelay(db.engine, publisher, tables=db.tables, config=config) as relay:
        started = time.monotonic()
        assert relay.run_once() == 0
        assert relay.run_once() == 0
        assert time.monotonic() - started < 20
        assert relay.parked() == []  # max_attempts=1: one charged attempt would have parked it
    ob = db.tables.outbox
    with db.engine.connect() as conn:
        row = conn.execute(select(ob.c.attempts, ob.c.published_at, ob.c.last_error)).one()
    assert (row.attempts, row.published_at, row.last_error) == (0, None, None)
