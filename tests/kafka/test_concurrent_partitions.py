"""The partitions of one fetch handled concurrently: each partition in order, bounded, and a
rebalance mid-run losing and doubling nothing (KafkaConfig.partitions_in_flight)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool, StaticPool

from consumerdedup import AsyncDeduplicator, Deduplicator, Message, Outcome, RetryPolicy
from consumerdedup.adapters.kafka import KafkaConfig, KafkaConsumerRunner
from consumerdedup.adapters.kafka.subscription import in_flight_limit
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)

QUICK_RETRY = RetryPolicy(attempts=2, initial_delay=timedelta(0), max_delay=timedelta(0))
FAST = {"poll_timeout": timedelta(milliseconds=100), "retry_delay": timedelta(0)}
TOGETHER = 10.0
"""Seconds a handler waits for a second partition to be in flight before it gives up."""


class Table:
    """A business table recording each message's partition and offset in insertion order."""

    def __init__(self, pg: Any) -> None:
        self.pg = pg
        self.name = pg.name("by_partition")
        with pg.engine.begin() as conn:
            conn.exec_driver_sql(
                f"CREATE TABLE {self.name} (seq SERIAL, partition INTEGER, "
                "record_offset BIGINT, message_id TEXT)"
            )
        self.insert = text(
            f"INSERT INTO {self.name} (partition, record_offset, message_id) VALUES (:p, :o, :m)"
        )
        self.engines: list[Any] = []  # the async handlers' engines, disposed at teardown

    def values(self, message: Message) -> dict[str, Any]:
        return {"p": message.partition, "o": message.offset, "m": message.id}

    def rows(self) -> list[tuple[int, int, str]]:
        with self.pg.engine.connect() as conn:
            sql = f"SELECT partition, record_offset, message_id FROM {self.name} ORDER BY seq"
            return [tuple(r) for r in conn.exec_driver_sql(sql)]  # type: ignore[misc]

    def count(self) -> int:
        return len(self.rows())

    def assert_each_once_in_partition_order(self, ids: set[str]) -> None:
        rows = self.rows()
        assert len(rows) == len(ids), f"{len(rows)} rows for {len(ids)} ids"
        assert {mid for _, _, mid in rows} == ids
        for partition in {p for p, _, _ in rows}:
            offsets = [o for p, o, _ in rows if p == partition]
            assert offsets == sorted(offsets), f"partition {partition} out of order: {offsets}"


class Together:
    """Holds each handler call until chunks of two partitions are in flight (or TOGETHER
    seconds pass, which the test then reports): proof that they overlap."""

    def __init__(self) -> None:
        self.partitions: set[int] = set()
        self.overlapped = threading.Event()
        self.timed_out = False
        self._lock = threading.Lock()

    def arrive(self, partition: int | None) -> bool:
        with self._lock:
            self.partitions.add(int(partition or 0))
            if len(self.partitions) >= 2:
                self.overlapped.set()
        return self.overlapped.is_set()

    def wait_blocking(self, partition: int | None) -> None:
        if not self.arrive(partition) and not self.overlapped.wait(TOGETHER):
            self.timed_out = True

    async def wait_async(self, partition: int | None) -> None:
        deadline = time.monotonic() + TOGETHER
        while not self.arrive(partition):  # polled: the blocking twin sets it from a thread
            if time.monotonic() > deadline:
                self.timed_out = True
                return
            await asyncio.sleep(0.005)


def handler(pg: Any, table: Table, kind: str, before: Callable[..., Any] | None = None) -> Any:
    if kind == "blocking":
        dedup = Deduplicator(pg.engine, consumer="ledger", tables=pg.tables, retry=QUICK_RETRY)

        @dedup.handler
        def handle_blocking(message: Message, session: Any) -> None:
            if before is not None:
                before(message)
            session.execute(table.insert, table.values(message))

        return handle_blocking
    engine = pg.async_engine()
    table.engines.append(engine)
    async_dedup = AsyncDeduplicator(engine, consumer="ledger", tables=pg.tables, retry=QUICK_RETRY)

    @async_dedup.handler
    async def handle(message: Message, session: Any) -> None:
        if before is not None:
            await before(message)
        await session.execute(table.insert, table.values(message))

    return handle


def runner(kafka: KafkaService, handle: Any, topic: str, **config: Any) -> KafkaConsumerRunner:
    return KafkaConsumerRunner(
        handle,
        topic,
        bootstrap_servers=kafka.bootstrap,
        group_id=config.pop("group_id", "group-" + topic),
        config=kafka.config(**{**FAST, **config}),
    )


def _events(start: int, stop: int) -> list[tuple[str, bytes]]:
    return [(f"e-{i:04d}", json.dumps({"n": i}).encode()) for i in range(start, stop)]


async def fill(topics: Topics, name: str, count: int, later: int = 0) -> tuple[str, set[str]]:
    """A 4-partition topic with ``count`` events, the last ``later`` of them not produced yet
    (``second_joins_mid_run`` produces them once the second runner owns partitions)."""
    topic = await topics.create(name, partitions=4)
    await topics.produce_many(topic, _events(0, count - later), partitions=4)
    return topic, {eid for eid, _ in _events(0, count)}


@pytest.fixture
async def table(pg: Any) -> Any:
    made = Table(pg)
    yield made
    for engine in made.engines:
        await engine.dispose()


@pytest.mark.parametrize("kind", ["async", "blocking"])
async def test_the_partitions_of_a_fetch_are_in_flight_together_each_in_order(
    kafka: KafkaService, topics: Topics, pg: Any, table: Table, kind: str
) -> None:
    together = Together()
    topic, ids = await fill(topics, "together", 80)
    before = together.wait_async if kind == "async" else together.wait_blocking
    handle = handler(pg, table, kind, lambda m: before(m.partition))
    run = runner(kafka, handle, topic, batch_size=5)
    await run.run(until_idle=True)

    assert not together.timed_out, "no two partitions were ever in flight together"
    assert together.partitions == {0, 1, 2, 3}
    table.assert_each_once_in_partition_order(ids)
    assert run.outcomes == {Outcome.PROCESSED: len(ids)}
    assert await topics.lag("group-" + topic, topic) == 0


def _share(*runners: KafkaConsumerRunner) -> bool:
    """Every runner owns partitions, and together all four: the rebalance is done."""
    owned = [r.consumer.assignment() if r.consumer is not None else set() for r in runners]
    return all(owned) and sum(map(len, owned)) == 4


async def second_joins_mid_run(
    first: KafkaConsumerRunner,
    second: KafkaConsumerRunner,
    table: Table,
    ids: list[str],
    topics: Topics,
    topic: str,
    group: str,
    *,
    after: int,
    later: int = 0,
) -> None:
    """Run ``first``; once it has applied ``after`` rows start ``second`` (a rebalance while
    chunks are in flight); wait until every id is applied and the group has no lag.

    ``later``: the last events (``fill``'s) are produced once the two share the partitions,
    so the second runner gets records by construction: the first could otherwise finish
    the stream before the rebalance, and 'the second got a partition' rested on luck."""
    tasks = [asyncio.create_task(first.run())]
    try:
        deadline = time.monotonic() + 60
        while table.count() < after:
            assert time.monotonic() < deadline, "the first runner made no progress"
            assert not tasks[0].done(), tasks[0]
            await asyncio.sleep(0.02)
        tasks.append(asyncio.create_task(second.run()))
        if later:
            while not _share(first, second):
                assert time.monotonic() < deadline, "the two runners never shared the topic"
                assert not any(t.done() for t in tasks), [t for t in tasks if t.done()]
                await asyncio.sleep(0.02)
            await topics.produce_many(topic, _events(len(ids) - later, len(ids)), partitions=4)
        while table.count() < len(ids) or await topics.lag(group, topic):
            assert time.monotonic() < deadline, f"{table.count()} of {len(ids)} applied"
            assert not any(t.done() for t in tasks), [t for t in tasks if t.done()]
            await asyncio.sleep(0.05)
    finally:
        first.stop()
        second.stop()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)


async def test_a_rebalance_mid_run_loses_nothing_and_doubles_nothing(
    kafka: KafkaService, topics: Topics, pg: Any, table: Table
) -> None:
    """Two blocking-handler members, each with four chunks in flight; the second joins while
    the first is mid-stream: every record once, each partition in offset order."""
    topic, ids = await fill(topics, "rebalance", 800, later=200)
    group = "group-" + topic

    def slow(message: Message) -> None:
        time.sleep(0.001)  # work, so that chunks are in flight when the rebalance comes

    first, second = (
        runner(kafka, handler(pg, table, "blocking", slow), topic, group_id=group, batch_size=20)
        for _ in range(2)
    )
    await second_joins_mid_run(
        first, second, table, ids, topics, topic, group, after=100, later=200
    )
    table.assert_each_once_in_partition_order(ids)
    assert second.outcomes[Outcome.PROCESSED] > 0, "the second runner never got a partition"


async def test_an_error_in_one_partition_stops_the_run_with_that_error(
    kafka: KafkaService, topics: Topics, pg: Any, table: Table
) -> None:
    """The before_ack hook of one chunk raises: run() raises that error itself (not an
    ExceptionGroup), the other chunks are abandoned, and what they did not commit comes again."""
    topic, ids = await fill(topics, "crash", 40)
    handle = handler(pg, table, "async")
    crashed = []

    def crash(results: Any) -> None:
        if not crashed:
            crashed.append(results)
            raise RuntimeError("crash after the commit")

    run = KafkaConsumerRunner(
        handle,
        topic,
        bootstrap_servers=kafka.bootstrap,
        group_id="group-" + topic,
        config=kafka.config(**FAST, batch_size=5),
        before_ack=crash,
    )
    with pytest.raises(RuntimeError, match="crash after the commit"):
        await run.run(until_idle=True)
    await runner(kafka, handle, topic, batch_size=5).run(until_idle=True)
    table.assert_each_once_in_partition_order(ids)


@pytest.fixture
def sqlite_engine() -> Iterator[Any]:
    engine = create_engine("sqlite://", poolclass=StaticPool)
    yield engine
    engine.dispose()


def test_in_flight_is_bounded_by_the_connections_the_engine_can_give(
    sqlite_engine: Any, postgres_url: str
) -> None:
    assert KafkaConfig().partitions_in_flight == 4
    assert in_flight_limit(sqlite_engine, 4) == 1  # one writer, one shared connection
    small = create_engine(postgres_url, pool_size=2)
    unpooled = create_engine(postgres_url, poolclass=NullPool)
    async_default = create_async_engine(postgres_url.replace("+psycopg", "+psycopg_async"))
    try:
        assert in_flight_limit(small, 4) == 2
        assert in_flight_limit(unpooled, 8) == 8
        assert in_flight_limit(async_default, 4) == 4  # pool_size 5
        assert in_flight_limit(small, 1) == 1
    finally:
        small.dispose()
        unpooled.dispose()
        async_default.sync_engine.dispose()
    with pytest.raises(Exception, match="partitions_in_flight"):
        KafkaConfig(partitions_in_flight=0)
