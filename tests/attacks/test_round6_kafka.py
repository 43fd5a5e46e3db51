"""Round 6 on the Kafka runner (real Tansu and PostgreSQL).

- The stale-fetch fix (a3e9241, ``acks.read_again``): a rebalance that hands the same
  partition back while a ``getmany`` is in flight makes what that getmany returns stale.
  Before the fix those records were dropped while the consumer's position stayed past
  them, and the next fetch's offset commit skipped them for good. Made deterministic: the
  runner waits in a long ``getmany`` on an empty topic; a second member joins the group
  with a subscription to another topic (so the runner is revoked and given the same
  partition back); only then are the first records produced, so the getmany in flight
  returns them after the revocation. Fails 3 of 3 on the code before a3e9241 (the five
  first records committed past, never applied), passes after.
- The same with a batch in flight instead (the second partition's chunk of that fetch
  waits its turn through the revocation): aiokafka's new assignment reads that partition
  from its committed offset anyway, so it passed before the fix too; kept as the guard
  of ``read_again``'s other caller.
- Hostile ids (NUL, not UTF-8, 256 characters, empty) in the id header and in keys read by
  ``KafkaConfig.key``, across an async bulk handler: held when written.
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from sqlalchemy import text

from consumerdedup import AsyncDeduplicator, ConfigurationError, Message, Outcome
from consumerdedup.adapters.kafka import KafkaConsumerRunner
from consumerdedup.headers import REASON_HEADER
from tests.kafka.test_runner import Ledger, body
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)

pytestmark = pytest.mark.postgres

LONG_POLL = timedelta(seconds=30)
"""The runner's getmany wait: the rebalance and the first records come inside one."""


@pytest.fixture
async def ledger(pg: Any) -> Any:
    made = Ledger(pg)
    yield made
    await made.close()


async def until(condition: Any, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_a_rebalance_giving_the_partition_back_during_a_getmany_loses_no_record(
    kafka: KafkaService, topics: Topics, ledger: Ledger
) -> None:
    topic = await topics.create("stale")
    elsewhere = await topics.create("stale-other")
    group = "group-" + topic
    tp = TopicPartition(topic, 0)
    run = KafkaConsumerRunner(
        ledger.handle,
        topic,
        bootstrap_servers=kafka.bootstrap,
        group_id=group,
        config=kafka.config(poll_timeout=LONG_POLL, retry_delay=timedelta(0)),
    )
    task = asyncio.create_task(run.run())
    other: Any = None
    try:

        async def assigned() -> bool:
            assert not task.done(), task
            return run.consumer is not None and run.consumer.assignment() == {tp}

        await until(assigned, "the runner's first assignment")
        window = time.monotonic()  # its getmany waits LONG_POLL from about now
        # Another member of the group, on another topic: the runner is revoked, then
        # given its partition back, while its getmany waits.
        other = AIOKafkaConsumer(
            elsewhere, bootstrap_servers=kafka.bootstrap, group_id=group, **kafka.group_options
        )
        await other.start()

        async def rebalanced() -> bool:
            return bool(other.assignment() == {TopicPartition(elsewhere, 0)})

        await until(rebalanced, "the second member's assignment (the rebalance done)")
        await until(assigned, "the runner's partition given back")
        first = [f"a-{i}" for i in range(5)]
        for eid in first:
            await topics.produce(topic, body(), event_id=eid)
        # The premise: the getmany that returns them is the one in flight since before the
        # revocation, so they are stale.
        assert time.monotonic() - window < LONG_POLL.total_seconds() - 5, "too slow a rebalance"

        async def read_past_them() -> bool:
            return run.consumer is not None and await run.consumer.position(tp) >= len(first)

        await until(read_past_them, "the runner to read the first records")
        later = [f"b-{i}" for i in range(5)]
        for eid in later:
            await topics.produce(topic, body(), event_id=eid)

        async def all_committed() -> bool:
            assert not task.done(), task
            return (await topics.committed(group, topic))[0] >= len(first) + len(later)

        await until(all_committed, "the group's offset at the end")
        applied = ledger.applied()
        assert sorted(applied) == sorted(first + later), (
            f"committed past records never applied: {sorted(set(first + later) - set(applied))}"
        )
    finally:
        task.cancel()  # idle in a long getmany: a cancel commits nothing more
        await asyncio.gather(task, return_exceptions=True)
        if other is not None:
            await other.stop()


async def test_a_rebalance_giving_the_partitions_back_during_a_batch_loses_no_record(
    kafka: KafkaService, topics: Topics, ledger: Ledger
) -> None:
    """The other stale case: a fetch of two partitions, one chunk at a time; the first
    chunk's handler is still running when the revocation starts (the handler waits for
    it), so the second partition's fetched records are stale when their turn comes."""
    topic = await topics.create("stale-batch", partitions=2)
    elsewhere = await topics.create("stale-batch-other")
    group = "group-" + topic
    events = [(f"e-{i}", body(i)) for i in range(12)]
    await topics.produce_many(topic, events, partitions=2)
    run = KafkaConsumerRunner(
        ledger.handle,
        topic,
        bootstrap_servers=kafka.bootstrap,
        group_id=group,
        config=kafka.config(
            poll_timeout=timedelta(milliseconds=200), partitions_in_flight=1, batch_size=50
        ),
    )
    started = asyncio.Event()
    held: list[str] = []

    async def revocation_started() -> bool:
        # aiokafka marks the reassignment before it calls the revocation listener, which
        # waits for this chunk: seen from the handler, the rebalance is under way.
        return bool(run.consumer._subscription.reassignment_in_progress)

    async def before(message: Any) -> None:
        if not held:
            held.append(message.id)
            started.set()
            await until(revocation_started, "the revocation", timeout=30)

    ledger.before = before
    task = asyncio.create_task(run.run())
    other: Any = None
    try:
        await asyncio.wait_for(started.wait(), 30)
        other = AIOKafkaConsumer(
            elsewhere, bootstrap_servers=kafka.bootstrap, group_id=group, **kafka.group_options
        )
        await other.start()

        async def all_committed() -> bool:
            assert not task.done(), task
            return sum((await topics.committed(group, topic)).values()) >= len(events)

        await until(all_committed, "the group's offsets at the end")
        applied = ledger.applied()
        assert sorted(applied) == sorted(eid for eid, _ in events)
        assert len(applied) == len(set(applied))
    finally:
        run.stop()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 30)
        if other is not None:
            await other.stop()


HOSTILE_IDS: list[tuple[bytes, bool]] = [
    (b"ok-1", True),
    (b"nul\x00inside", False),  # PostgreSQL text cannot hold NUL
    (b"\xff\xfenot-utf-8", False),  # refused, never decoded into a guess
    (b"x" * 256, False),  # one past MAX_ID_LENGTH
    ("é".encode() * 255, True),  # 255 characters in 510 bytes: a valid id
    (b"", False),
    (b"ok-2", True),
]


async def test_hostile_ids_across_a_bulk_handler_fail_alone_and_nothing_is_skipped(
    kafka: KafkaService, topics: Topics, pg: Any
) -> None:
    """Ids in the id header (and, without one, keys through ``KafkaConfig.key``) that no
    database can hold, or that are not UTF-8, in one fetch for an async bulk handler: each
    is FAILED and dead-lettered alone, never handed to the handler; the others applied once;
    the group's offset at the end."""
    topic = await topics.create("hostile-ids")
    for raw_id, _ in HOSTILE_IDS:
        await topics.produce(topic, body(), event_id=raw_id)
    keyed = [(b"key\x00nul", False), (b"\xc3\x28", False), (b"key-ok", True)]
    for key, _ in keyed:
        await topics.produce(topic, body(), key=key)
    engine = pg.async_engine()
    ledger = pg.create_ledger()
    dedup = AsyncDeduplicator(engine, consumer="hostile", tables=pg.tables)
    calls: list[list[str]] = []
    insert = text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', 1, :m)")

    @dedup.bulk_handler
    async def place(messages: list[Message], session: Any) -> None:
        calls.append([m.id for m in messages])
        await session.execute(insert, [{"m": m.id} for m in messages])

    def key(message: Message) -> str | None:
        return message.raw.key.decode() if message.raw.key is not None else None

    run = KafkaConsumerRunner(
        place,
        topic,
        bootstrap_servers=kafka.bootstrap,
        group_id="group-" + topic,
        config=kafka.config(
            poll_timeout=timedelta(milliseconds=100), retry_delay=timedelta(0), key=key
        ),
    )
    try:
        await asyncio.wait_for(run.run(until_idle=True), 60)
    finally:
        await engine.dispose()
    good = [raw.decode() for raw, ok in HOSTILE_IDS if ok] + ["key-ok"]
    with pg.engine.connect() as conn:
        applied = sorted(r[0] for r in conn.exec_driver_sql(f"SELECT message_id FROM {ledger}"))
    assert applied == sorted(good)
    assert sorted(mid for call in calls for mid in call) == sorted(good), calls
    bad = len(HOSTILE_IDS) + len(keyed) - len(good)
    assert run.outcomes == {Outcome.PROCESSED: len(good), Outcome.FAILED: bad}
    dead = await topics.records(topic + ".dlq")
    assert len(dead) == bad
    assert all(REASON_HEADER in dict(r.headers) for r in dead)
    assert await topics.lag("group-" + topic, topic) == 0


@pytest.mark.parametrize(
    "error", [SystemExit(3), KeyboardInterrupt(), asyncio.CancelledError()], ids=type
)
async def test_a_base_exception_mid_bulk_call_commits_nothing_and_no_offset(
    kafka: KafkaService, topics: Topics, pg: Any, error: BaseException
) -> None:
    """Raised by an async bulk handler after half its writes: it leaves run() as it is,
    nothing of the chunk is recorded or applied, no offset is committed."""
    topic = await topics.create("base-exc")
    for n in range(6):
        await topics.produce(topic, body(n), event_id=f"m-{n}")
    engine = pg.async_engine()
    ledger = pg.create_ledger()
    dedup = AsyncDeduplicator(engine, consumer="base", tables=pg.tables)
    insert = text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', 1, :m)")

    @dedup.bulk_handler
    async def place(messages: list[Message], session: Any) -> None:
        await session.execute(insert, [{"m": m.id} for m in messages[: len(messages) // 2 or 1]])
        raise error

    run = KafkaConsumerRunner(
        place,
        topic,
        bootstrap_servers=kafka.bootstrap,
        group_id="group-" + topic,
        config=kafka.config(poll_timeout=timedelta(milliseconds=100)),
    )
    raised: BaseException | None = None
    try:
        await run.run()  # not in a task of its own: SystemExit would leave the event loop
    except BaseException as exc:  # caught here, before the event loop sees it
        raised = exc
    finally:
        await engine.dispose()
    assert type(raised) is type(error), raised
    with pg.engine.connect() as conn:
        assert conn.exec_driver_sql(f"SELECT count(*) FROM {ledger}").scalar() == 0
        pe = pg.name("processed_events")
        assert conn.exec_driver_sql(f"SELECT count(*) FROM {pe}").scalar() == 0
    assert await topics.committed("group-" + topic, topic) == {0: 0}


async def test_a_cancelled_error_from_a_handler_with_partitions_in_flight_skips_nothing(
    kafka: KafkaService, topics: Topics, pg: Any
) -> None:
    """Partitions in flight together run as tasks (``all_of``); a handler's CancelledError
    ended its task as *cancelled*, which ``asyncio.wait(FIRST_EXCEPTION)`` does not count:
    the fetch was taken as handled, the runner went on, and the partition's next chunk
    committed its offset past the records never applied. Now it leaves run() as it is."""
    topic = await topics.create("cancel-inflight", partitions=2)
    events = [(f"e-{i}", body(i)) for i in range(8)]
    await topics.produce_many(topic, events, partitions=2)
    engine = pg.async_engine()
    ledger = pg.create_ledger()
    dedup = AsyncDeduplicator(engine, consumer="cancel", tables=pg.tables)
    insert = text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', 1, :m)")
    raised: list[str] = []

    @dedup.bulk_handler
    async def place(messages: list[Message], session: Any) -> None:
        await session.execute(insert, [{"m": m.id} for m in messages])
        if messages[0].partition == 0 and not raised:
            raised.append(messages[0].id)
            raise asyncio.CancelledError  # a library's own cancellation, leaking out

    group = "group-" + topic
    run = KafkaConsumerRunner(
        place,
        topic,
        bootstrap_servers=kafka.bootstrap,
        group_id=group,
        config=kafka.config(poll_timeout=timedelta(milliseconds=100), partitions_in_flight=2),
    )
    task = asyncio.create_task(run.run())
    try:
        deadline = time.monotonic() + 30
        while not raised:
            assert time.monotonic() < deadline and not task.done(), task
            await asyncio.sleep(0.02)
        later = [(f"later-{i}", body(i)) for i in range(2)]
        for eid, value in later:
            await topics.produce(topic, value, event_id=eid, partition=0)
        while not task.done() and (await topics.committed(group, topic))[0] < 6:
            assert time.monotonic() < deadline, "the runner neither stopped nor moved on"
            await asyncio.sleep(0.05)
        with pg.engine.connect() as conn:
            applied = {r[0] for r in conn.exec_driver_sql(f"SELECT message_id FROM {ledger}")}
        committed = await topics.committed(group, topic)
        skipped = sorted({eid for eid, _ in events[::2]} - applied) if committed[0] else []
        assert task.done() and task.cancelled(), f"swallowed; committed past {skipped}"
        assert committed[0] == 0 and not applied & {eid for eid, _ in events[::2]}
    finally:
        run.stop()
        await asyncio.gather(task, return_exceptions=True)
        await engine.dispose()


async def test_the_source_topic_deleted_while_running_stops_the_runner_or_loses_nothing(
    kafka: KafkaService, topics: Topics, ledger: Ledger
) -> None:
    """The consumed topic deleted under a running runner, then records produced to its name.
    Before: on Tansu the runner read m-3, recorded it, and its offset commit was refused
    (UnknownTopicOrPartition), which aiokafka retries forever: run() never returned, stop()
    went unheard, nothing was said. Now either the records are applied and committed (a
    broker that re-creates the topic and drops its offsets, as Kafka does) or run() stops
    with a ConfigurationError naming the topic and the fix; nothing is acked uncommitted.
    (Tansu keeps the group's committed offset across the deletion, so its re-created
    topic's first record, m-2, is never read: a broker fault no consumer can see.)"""
    topic = await topics.create("gone")
    group = "group-" + topic
    run = KafkaConsumerRunner(
        ledger.handle,
        topic,
        bootstrap_servers=kafka.bootstrap,
        group_id=group,
        config=kafka.config(poll_timeout=timedelta(milliseconds=100)),
    )
    task = asyncio.create_task(run.run())
    try:
        await topics.produce(topic, body(1), event_id="m-1")

        async def first_applied() -> bool:
            assert not task.done(), task
            return ledger.applied() == ["m-1"]

        await until(first_applied, "m-1 applied")
        admin, _, _ = await topics._clients()
        await admin.delete_topics([topic])
        for n in (2, 3):  # Tansu keeps the group's offset (1): m-2 is skipped there, m-3 read
            await topics.produce(topic, body(n), event_id=f"m-{n}")

        async def decided() -> bool:
            if task.done():
                return True
            return {"m-2", "m-3"} <= set(ledger.applied()) and await topics.lag(group, topic) == 0

        await until(decided, "the runner to stop, or the records to be applied and committed", 60)
        if task.done():
            error = task.exception()
            assert isinstance(error, ConfigurationError), error
            assert topic in str(error) and "Create the topic again" in str(error)
    finally:
        run.stop()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 30)
