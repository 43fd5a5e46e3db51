"""run(until_idle=True) across a rebalance: a partition given away while the runner asks
whether it is idle is not its to judge (neither drained by it nor an error), and idle is not
declared while a partition it owns has records unread or uncommitted.

The rebalance is put at the exact point: the first member's ``committed`` call inside the
idle check waits until a second member has joined and the first member's new assignment
(nothing: the test's assignor gives every partition to the newest member) is in place."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer, ConsumerRebalanceListener  # type: ignore[import-untyped]
from aiokafka.coordinator.assignors.abstract import (  # type: ignore[import-untyped]
    AbstractPartitionAssignor,
)
from aiokafka.coordinator.protocol import (  # type: ignore[import-untyped]
    ConsumerProtocolMemberAssignment,
    ConsumerProtocolMemberMetadata,
)
from sqlalchemy import text

from consumerdedup import AsyncDeduplicator, Message, Outcome, RetryPolicy
from consumerdedup.adapters.kafka import OFFSET_HEADER, KafkaConsumerRunner
from consumerdedup.adapters.kafka import connection as kafka_connection
from tests.kafka.test_attack_round3 import NotUtf8, raw_header_keys_fixture  # noqa: F401
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)

QUICK_RETRY = RetryPolicy(attempts=2, initial_delay=timedelta(0), max_delay=timedelta(0))
FAST = {"poll_timeout": timedelta(milliseconds=100), "retry_delay": timedelta(0)}
WAIT = 60.0
"""Seconds any one step may take before the test fails (a hang is a failure, not a wait)."""


class _Newest(AbstractPartitionAssignor):  # type: ignore[misc]
    """Every partition to the member of the highest rank (its user_data): the group's
    assignment after a join is known in advance."""

    name = "cdd-newest-takes-all"
    version = 0
    rank = b"0"

    @classmethod
    def assign(cls, cluster: Any, members: Mapping[str, Any]) -> dict[str, Any]:
        newest = max(members, key=lambda m: (members[m].user_data, m))
        topics = sorted({t for meta in members.values() for t in meta.subscription})
        everything = [(t, sorted(cluster.partitions_for_topic(t) or ())) for t in topics]
        return {
            m: ConsumerProtocolMemberAssignment(cls.version, everything if m == newest else [], b"")
            for m in members
        }

    @classmethod
    def metadata(cls, topics: Iterable[str]) -> Any:
        return ConsumerProtocolMemberMetadata(cls.version, list(topics), cls.rank)

    @classmethod
    def on_assignment(cls, assignment: Any) -> None:
        pass


class FirstMember(_Newest):
    rank = b"1"


class SecondMember(_Newest):
    rank = b"2"


class Watched(ConsumerRebalanceListener):  # type: ignore[misc]
    """The runner's listener, and each assignment it was told of, in a queue."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.assignments: asyncio.Queue[set[Any]] = asyncio.Queue()

    async def on_partitions_revoked(self, revoked: Any) -> None:
        await self.inner.on_partitions_revoked(revoked)

    async def on_partitions_assigned(self, assigned: Any) -> None:
        await self.inner.on_partitions_assigned(assigned)
        self.assignments.put_nowait(set(assigned))


class Gate:
    """Holds the first member's first ``committed`` call made once ``ready()``, until released."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.used = False


class Ledger:
    """The business table (no unique key: only dedup keeps a record from applying twice)."""

    def __init__(self, pg: Any) -> None:
        self.pg = pg
        self.name = pg.name("idle_ledger")
        with pg.engine.begin() as conn:
            conn.exec_driver_sql(f"CREATE TABLE {self.name} (message_id TEXT, partition INTEGER)")
        self.engines: list[Any] = []
        self.handled = 0  # handler calls, committed or not

    def handler(self) -> Any:
        engine = self.pg.async_engine()
        self.engines.append(engine)
        dedup = AsyncDeduplicator(
            engine, consumer="ledger", tables=self.pg.tables, retry=QUICK_RETRY
        )
        insert = text(f"INSERT INTO {self.name} (message_id, partition) VALUES (:m, :p)")

        @dedup.handler
        async def handle(message: Message, session: Any) -> None:
            self.handled += 1
            await session.execute(insert, {"m": message.id, "p": message.partition})

        return handle

    def ids(self) -> list[str]:
        with self.pg.engine.connect() as conn:
            return [r[0] for r in conn.exec_driver_sql(f"SELECT message_id FROM {self.name}")]

    def processed(self) -> list[str]:
        sql = f"SELECT message_id FROM {self.pg.name('processed_events')}"
        with self.pg.engine.connect() as conn:
            return [r[0] for r in conn.exec_driver_sql(sql)]

    def assert_each_once(self, ids: set[str]) -> None:
        applied, processed = self.ids(), self.processed()
        assert sorted(applied) == sorted(ids), "business rows: not each record exactly once"
        assert sorted(processed) == sorted(ids), "processed_events: not each record exactly once"


@pytest.fixture
async def ledger(pg: Any) -> Any:
    made = Ledger(pg)
    yield made
    for engine in made.engines:
        await engine.dispose()


def member(
    kafka: KafkaService, handle: Any, topic: str, group: str, assignor: type | None = None
) -> KafkaConsumerRunner:
    options = {} if assignor is None else {"partition_assignment_strategy": (assignor,)}
    return KafkaConsumerRunner(
        handle,
        topic,
        bootstrap_servers=kafka.bootstrap,
        group_id=group,
        config=kafka.config(batch_size=10, consumer_options=options, **FAST),
    )


async def fill(topics: Topics, topic: str, first: int, count: int, partitions: int) -> set[str]:
    events = [(f"e-{i:04d}", json.dumps({"n": i}).encode()) for i in range(first, first + count)]
    await topics.produce_many(topic, events, partitions=partitions)
    return {eid for eid, _ in events}


async def test_a_partition_given_away_during_the_idle_check_is_not_an_error(
    kafka: KafkaService,
    topics: Topics,
    pg: Any,
    ledger: Ledger,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    topic = await topics.create("idle-rebalance", partitions=2)
    group = f"cdd-idle-{uuid.uuid4().hex[:10]}"
    ids = await fill(topics, topic, 0, 40, partitions=2)
    first = member(kafka, ledger.handler(), topic, group, FirstMember)
    second = member(kafka, ledger.handler(), topic, group, SecondMember)
    gate, watched = Gate(), {}
    made = kafka_connection.consumer

    def consumer(*args: Any) -> Any:  # the first member's consumer, instrumented for timing
        made_consumer = made(*args)
        if watched:
            return made_consumer
        subscribe, committed = made_consumer.subscribe, made_consumer.committed

        def subscribe_watched(topics: Any, listener: Any) -> None:
            watched["listener"] = Watched(listener)
            subscribe(topics, listener=watched["listener"])

        async def committed_held(tp: Any) -> Any:
            owned = made_consumer.assignment()
            if not gate.used and ledger.handled >= len(ids) and len(owned) == 2:
                gate.used = True  # in the idle check, every record handled, both partitions ours
                gate.entered.set()
                await gate.release.wait()
            return await committed(tp)

        made_consumer.subscribe, made_consumer.committed = subscribe_watched, committed_held
        watched["consumer"] = made_consumer
        return made_consumer

    monkeypatch.setattr(kafka_connection, "consumer", consumer)
    runs = [asyncio.create_task(first.run(until_idle=True))]
    try:
        await asyncio.wait_for(gate.entered.wait(), WAIT)
        # Records the first member owns but does not read (it is in its idle check): they are
        # the second member's once it has joined.
        ids |= await fill(topics, topic, 40, 20, partitions=2)
        runs.append(asyncio.create_task(second.run(until_idle=True)))
        while await asyncio.wait_for(watched["listener"].assignments.get(), WAIT):
            pass  # until the first member's assignment after the join: nothing
        assert watched["consumer"].assignment() == set(), "the first member still owns some"
        gate.release.set()
        done, _ = await asyncio.wait(runs, timeout=WAIT)
        assert len(done) == 2, "a member did not return once the group was idle"
        for run in runs:
            run.result()  # the first member's idle check raised nothing
    finally:
        gate.release.set()
        first.stop()
        second.stop()
        await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), 30)

    ledger.assert_each_once(ids)
    assert first.outcomes == {Outcome.PROCESSED: 40}, first.outcomes
    assert second.outcomes == {Outcome.PROCESSED: 20}, second.outcomes
    assert await topics.lag(group, topic) == 0


async def test_two_members_until_idle_each_return_having_processed_each_record_once(
    kafka: KafkaService, topics: Topics, pg: Any, ledger: Ledger
) -> None:
    topic = await topics.create("idle-pair", partitions=4)
    group = f"cdd-idle-{uuid.uuid4().hex[:10]}"
    ids = await fill(topics, topic, 0, 200, partitions=4)
    members = [member(kafka, ledger.handler(), topic, group) for _ in range(2)]
    runs = [asyncio.create_task(m.run(until_idle=True)) for m in members]
    try:
        done, _ = await asyncio.wait(runs, timeout=WAIT)
        assert len(done) == 2, "a member did not return once the group was idle"
        for run in runs:
            run.result()
    finally:
        for m in members:
            m.stop()
        await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), 30)

    ledger.assert_each_once(ids)
    processed = sum(m.outcomes.get(Outcome.PROCESSED, 0) for m in members)
    assert processed == len(ids)
    assert await topics.lag(group, topic) == 0


async def test_a_partition_given_away_while_its_undecodable_range_is_measured_is_not_an_error(
    kafka: KafkaService,
    topics: Topics,
    pg: Any,
    ledger: Ledger,
    raw_header_keys: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same class of race in reading past a record aiokafka cannot decode: the first
    member finds it, asks the broker where the partition ends, and the partition is given
    away during that await. Not an error (highwater() raised AssertionError): the range is
    not the first member's to refuse; the second member refuses it, once."""
    topic = await topics.create("undecodable-rebalance", partitions=1)
    group = f"cdd-idle-{uuid.uuid4().hex[:10]}"
    producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap, acks="all", linger_ms=200)
    await producer.start()
    try:  # one batch: a readable record, the undecodable one, a readable one; then another
        sent = [
            await producer.send(topic, b"{}", partition=0, headers=[("event_id", b"u-a")]),
            await producer.send(
                topic, b"{}", partition=0, headers=[(NotUtf8("k"), b"v"), ("event_id", b"u-b")]
            ),
            await producer.send(topic, b"{}", partition=0, headers=[("event_id", b"u-c")]),
        ]
        assert [(await future).offset for future in sent] == [0, 1, 2]
        await producer.send_and_wait(topic, b"{}", partition=0, headers=[("event_id", b"u-z")])
    finally:
        await producer.stop()
    first = member(kafka, ledger.handler(), topic, group, FirstMember)
    second = member(kafka, ledger.handler(), topic, group, SecondMember)
    gate, watched = Gate(), {}
    made = kafka_connection.consumer

    def consumer(*args: Any) -> Any:  # the first member's consumer, instrumented for timing
        made_consumer = made(*args)
        if watched:
            return made_consumer
        subscribe, position, end_offsets = (
            made_consumer.subscribe,
            made_consumer.position,
            made_consumer.end_offsets,
        )

        def subscribe_watched(topics: Any, listener: Any) -> None:
            watched["listener"] = Watched(listener)
            subscribe(topics, listener=watched["listener"])

        async def position_seen(tp: Any) -> Any:  # asked only after an undecodable record
            watched["undecodable"] = True
            return await position(tp)

        async def end_offsets_held(tps: Any) -> Any:
            if not gate.used and watched.get("undecodable"):
                gate.used = True
                gate.entered.set()
                await gate.release.wait()
            return await end_offsets(tps)

        made_consumer.subscribe, made_consumer.position = subscribe_watched, position_seen
        made_consumer.end_offsets = end_offsets_held
        watched["consumer"] = made_consumer
        return made_consumer

    monkeypatch.setattr(kafka_connection, "consumer", consumer)
    runs = [asyncio.create_task(first.run(until_idle=True))]
    try:
        await asyncio.wait_for(gate.entered.wait(), WAIT)
        runs.append(asyncio.create_task(second.run(until_idle=True)))
        while await asyncio.wait_for(watched["listener"].assignments.get(), WAIT):
            pass  # until the first member's assignment after the join: nothing
        gate.release.set()
        done, _ = await asyncio.wait(runs, timeout=WAIT)
        assert len(done) == 2, "a member did not return once the group was idle"
        for run in runs:
            run.result()  # the first member raised nothing
    finally:
        gate.release.set()
        first.stop()
        second.stop()
        await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), 30)

    assert sorted(ledger.ids()) == ["u-a", "u-z"]
    assert sorted(ledger.processed()) == ["u-a", "u-z"]
    assert first.outcomes == {}, first.outcomes  # it handled nothing of the stale read
    dead = await topics.records(topic + ".dlq")
    assert [dict(r.headers)[OFFSET_HEADER] for r in dead] == [b"1", b"2"]  # refused once
    assert await topics.committed(group, topic) == {0: 4}
