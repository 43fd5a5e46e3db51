"""Kafka offsets kept in the database (``KafkaConfig(offsets="database")``, issue 36).

On the real broker (Tansu) and PostgreSQL. Most tests run with ``claim_ids=False``: no
processed_events row per record, so the offset in the database is the only thing standing
between a redelivery and a doubled effect, and a replay would show in the ledger.

- kill -9 between the database COMMIT and the broker commit: the restart reads from the
  database, nothing is doubled, and the broker's commit catches up;
- a slow old owner (its event loop frozen past its session) and a new owner on the same
  partition: the old owner's chunk is fenced by the owner epoch and rolls back;
- a partition moved to a consumer whose broker offset is behind the database's (no replay)
  or ahead of it (no skip);
- what ``claim_ids`` changes: a producer's copy at another offset, FAILED records.

Run as a script, this module is the runner process the kill -9 test kills.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from consumerdedup import (
    AsyncDeduplicator,
    ConfigurationError,
    Message,
    Outcome,
    PermanentError,
    Result,
    RetryPolicy,
    SimulatedCrash,
    Tables,
)
from consumerdedup.adapters.kafka import KafkaConfig, KafkaConsumerRunner
from consumerdedup.adapters.kafka.offsets import OffsetStore
from tests.support.cli import Cli, cli_fixture  # noqa: F401
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)

pytestmark = pytest.mark.postgres

ROOT = Path(__file__).resolve().parents[2]
QUICK = RetryPolicy(attempts=2, initial_delay=timedelta(0), max_delay=timedelta(0))
FAST = {"poll_timeout": timedelta(milliseconds=100), "retry_delay": timedelta(0)}
DEADLINE = 60.0


def ledger_handler(
    engine: AsyncEngine, tables: Tables, ledger: str, who: str, calls: list[str] | None = None
) -> Any:
    """Writes one ledger row per message (as ``who``); a body with "fail" fails for good."""
    dedup = AsyncDeduplicator(engine, consumer="ledger", tables=tables, retry=QUICK)

    @dedup.handler
    async def handle(message: Message, session: Any) -> None:
        if calls is not None:
            calls.append(message.id)
        data = message.json()
        if data.get("fail"):
            raise PermanentError("refused by the handler")
        await session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES (:who, :n, :m)"),
            {"who": who, "n": data["n"], "m": message.id},
        )

    return handle


def make_runner(
    kafka: KafkaService,
    handle: Any,
    topic: str,
    group: str,
    *,
    before_ack: Any = None,
    **config: Any,
) -> KafkaConsumerRunner:
    options = {**FAST, "offsets": "database", **config}
    return KafkaConsumerRunner(
        handle,
        topic,
        bootstrap_servers=kafka.bootstrap,
        group_id=group,
        config=kafka.config(**options),
        before_ack=before_ack,
    )


def events(first: int, last: int) -> list[tuple[str, bytes]]:
    return [(f"e-{i:04d}", json.dumps({"n": i}).encode()) for i in range(first, last)]


def applied(pg: Any, ledger: str, who: str | None = None) -> list[str]:
    where = "" if who is None else f" WHERE account = '{who}'"
    with pg.engine.connect() as conn:
        return [r[0] for r in conn.exec_driver_sql(f"SELECT message_id FROM {ledger}{where}")]


def stored(pg: Any, group: str, topic: str) -> tuple[int | None, int]:
    """(next offset, owner epoch) of partition 0 in consumer_offsets."""
    with pg.engine.connect() as conn:
        row = conn.exec_driver_sql(
            f"SELECT next_offset, owner_epoch FROM {pg.name('consumer_offsets')} "
            "WHERE consumer_group = %(g)s AND topic = %(t)s AND partition = 0",
            {"g": group, "t": topic},
        ).one()
    return row[0], row[1]


def recorded(pg: Any) -> int:
    return int(pg.scalar(f"SELECT count(*) FROM {pg.name('processed_events')}"))  # type: ignore[call-overload]


async def set_group_offset(kafka: KafkaService, group: str, topic: str, offset: int) -> None:
    """Commit ``offset`` for partition 0 as a member of the group (Tansu takes commits from
    members only), then leave."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=kafka.bootstrap,
        group_id=group,
        enable_auto_commit=False,
        **kafka.group_options,
    )
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.subscribe([topic])
        await until(lambda: _polled(consumer, tp), "the offset setter to be assigned the partition")
        await consumer.commit({tp: offset})
    finally:
        await consumer.stop()


async def _polled(consumer: Any, tp: Any) -> bool:
    await consumer.getmany(timeout_ms=50, max_records=1)  # drives the join; records unused
    return tp in consumer.assignment()


async def until(condition: Any, what: str, timeout: float = DEADLINE) -> None:
    """Poll ``condition()`` (sync or async) until true; fail after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


# The configuration


def test_the_options_are_checked_where_given() -> None:
    with pytest.raises(ConfigurationError, match=r"KafkaConfig\.offsets.*'database'.*'Database'"):
        KafkaConfig(offsets="Database")
    with pytest.raises(ConfigurationError, match=r"KafkaConfig\.claim_ids"):
        KafkaConfig(claim_ids=False)  # the broker's offsets cannot tell what was applied
    with pytest.raises(ConfigurationError, match=r"KafkaConfig\.claim_ids"):
        KafkaConfig(offsets="database", claim_ids="no")  # type: ignore[arg-type]
    assert KafkaConfig(offsets="database", claim_ids=False).offsets == "database"


# kill -9 between the database COMMIT and the broker commit


@pytest.mark.parametrize("claim_ids", [False, True], ids=["offsets-only", "with-claims"])
async def test_kill_9_between_the_database_commit_and_the_broker_commit(
    kafka: KafkaService, topics: Topics, pg: Any, claim_ids: bool
) -> None:
    ledger = pg.create_ledger()
    topic = await topics.create("kill9")
    await topics.produce_many(topic, events(0, 60))
    group = "kill9-" + topic
    command = [sys.executable, "-m", "tests.kafka.test_offsets_in_database", kafka.bootstrap]
    command += [topic, group, pg.async_url, pg.schema, ledger]
    command += [json.dumps(dict(kafka.group_options)), str(int(kafka.idempotence))]
    command += [str(int(claim_ids))]
    worker = subprocess.Popen(command, cwd=ROOT)
    try:
        assert worker.wait(DEADLINE) == -signal.SIGKILL  # killed itself in its third before_ack
    finally:
        if worker.poll() is None:
            worker.kill()
    # Three chunks of 10 committed in the database; the broker has only the first two.
    assert sorted(applied(pg, ledger)) == [eid for eid, _ in events(0, 30)]
    offset, epoch = stored(pg, group, topic)
    assert offset == 30
    assert await topics.committed(group, topic) == {0: 20}

    engine = pg.async_engine()
    calls: list[str] = []
    restarted = make_runner(
        kafka,
        ledger_handler(engine, pg.tables, ledger, "restart", calls),
        topic,
        group,
        batch_size=10,
        claim_ids=claim_ids,
    )
    try:
        await asyncio.wait_for(restarted.run(until_idle=True), DEADLINE)
    finally:
        await engine.dispose()

    assert calls == [eid for eid, _ in events(30, 60)]  # read from the database's offset
    assert sorted(applied(pg, ledger)) == [eid for eid, _ in events(0, 60)]  # once each
    assert restarted.outcomes[Outcome.DUPLICATE] == 0  # nothing was even read again
    assert stored(pg, group, topic) == (60, epoch + 1)
    assert await topics.committed(group, topic) == await topics.ends(topic)
    assert recorded(pg) == (60 if claim_ids else 0)


def _kill_9_worker(argv: Sequence[str]) -> None:
    """The runner the kill -9 test starts: SIGKILL from its third before_ack, that is after
    the third chunk's database COMMIT and before its broker commit."""
    bootstrap, topic, group, url, schema, ledger, options, idempotence, claim_ids = argv
    logging.basicConfig(level=logging.INFO)

    async def main() -> None:
        engine = create_async_engine(url)
        tables = Tables.define(f"{schema}.processed_events", f"{schema}.outbox")
        chunks: list[int] = []

        def die_on_third(results: Sequence[Result]) -> None:
            chunks.append(len(results))
            if len(chunks) == 3:
                os.kill(os.getpid(), signal.SIGKILL)

        config = KafkaConfig(
            batch_size=10,
            partitions_in_flight=1,
            offsets="database",
            claim_ids=bool(int(claim_ids)),
            idempotent_producer=bool(int(idempotence)),
            consumer_options=json.loads(options),
            **FAST,  # type: ignore[arg-type]
        )
        runner = KafkaConsumerRunner(
            ledger_handler(engine, tables, ledger, "worker"),
            topic,
            bootstrap_servers=bootstrap,
            group_id=group,
            config=config,
            before_ack=die_on_third,
        )
        await runner.run()

    asyncio.run(main())


# A slow old owner and a new owner on the same partition


async def test_a_slow_old_owner_is_fenced_and_nothing_is_doubled(
    kafka: KafkaService, topics: Topics, pg: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The old owner's event loop freezes inside a handler (a stop-the-world pause) past its
    session: the group gives the partition to the new owner, which takes the next owner
    epoch and reads from the database's offset. When the old owner wakes, its chunk's
    offset write changes no row: the chunk rolls back (its ledger rows with it)."""
    caplog.set_level(logging.WARNING, logger="consumerdedup")
    ledger = pg.create_ledger()
    topic = await topics.create("zombie")
    await topics.produce_many(topic, events(0, 50))
    group = "zombie-" + topic
    frozen, thaw = threading.Event(), threading.Event()
    old: dict[str, Any] = {}

    def old_owner() -> None:
        async def main() -> None:
            engine = pg.async_engine()
            dedup = AsyncDeduplicator(engine, consumer="ledger", tables=pg.tables, retry=QUICK)

            @dedup.handler
            async def handle(message: Message, session: Any) -> None:
                n = message.json()["n"]
                columns = "(account, amount, message_id)"
                insert = f"INSERT INTO {ledger} {columns} VALUES ('old', :n, :m)"
                await session.execute(text(insert), {"n": n, "m": message.id})
                if n == 25 and not frozen.is_set():
                    frozen.set()
                    thaw.wait(DEADLINE)  # blocks this whole event loop: no heartbeat either

            runner = make_runner(kafka, handle, topic, group, batch_size=10, claim_ids=False)
            old["runner"], old["loop"] = runner, asyncio.get_running_loop()
            try:
                await runner.run()
            finally:
                await engine.dispose()

        asyncio.run(main())

    thread = threading.Thread(target=old_owner, daemon=True)
    thread.start()
    engine = pg.async_engine()
    new = make_runner(
        kafka,
        ledger_handler(engine, pg.tables, ledger, "new"),
        topic,
        group,
        batch_size=10,
        claim_ids=False,
    )
    new_task: asyncio.Task[None] | None = None
    try:
        await until(frozen.is_set, "the old owner to freeze in its third chunk")
        offset, epoch = stored(pg, group, topic)
        assert offset == 20
        new_task = asyncio.create_task(new.run())
        await until(lambda: len(applied(pg, ledger, "new")) == 30, "the new owner to finish")
        assert stored(pg, group, topic)[1] > epoch  # the new owner took the next epoch
        thaw.set()
        await until(
            lambda: any("taken by another consumer" in r.getMessage() for r in caplog.records),
            "the old owner's chunk to be fenced",
        )
    finally:
        thaw.set()
        new.stop()
        if new_task is not None:
            await asyncio.wait_for(new_task, 30)
        if "loop" in old:  # a deadline: a zombie rejoining on Tansu may wait in its join
            old["loop"].call_soon_threadsafe(old["runner"].stop, 5.0)
        await asyncio.to_thread(thread.join, 30)
        await engine.dispose()
    assert not thread.is_alive(), "the old owner did not stop"

    mine = [eid for eid, _ in events(0, 50)]
    assert sorted(applied(pg, ledger)) == mine  # once each: the old chunk rolled back
    assert sorted(applied(pg, ledger, "old")) == mine[:20]
    assert sorted(applied(pg, ledger, "new")) == mine[20:]
    assert stored(pg, group, topic)[0] == 50


# A partition moved to a consumer whose broker offset differs from the database's


@pytest.mark.parametrize(
    ("broker_at", "where"), [(10, "behind"), (45, "ahead")], ids=["behind", "ahead"]
)
async def test_a_moved_partition_starts_at_the_database_offset(
    kafka: KafkaService,
    topics: Topics,
    pg: Any,
    caplog: pytest.LogCaptureFixture,
    broker_at: int,
    where: str,
) -> None:
    """The first consumer applies 0..29 and leaves; the group's broker offset is then put
    behind (10: a replay of 10..29 would double them) or ahead (45: 30..44 would be
    skipped) of the database's 30; the consumer the partition moves to starts at 30."""
    caplog.set_level(logging.INFO, logger="consumerdedup.kafka")
    ledger = pg.create_ledger()
    topic = await topics.create("moved")
    group = "moved-" + topic
    engine = pg.async_engine()
    try:
        await topics.produce_many(topic, events(0, 30))
        first = make_runner(
            kafka, ledger_handler(engine, pg.tables, ledger, "first"), topic, group, claim_ids=False
        )
        await asyncio.wait_for(first.run(until_idle=True), DEADLINE)
        offset, epoch = stored(pg, group, topic)
        assert offset == 30
        await topics.produce_many(topic, events(30, 60))
        await set_group_offset(kafka, group, topic, broker_at)
        assert await topics.committed(group, topic) == {0: broker_at}, where

        calls: list[str] = []
        second = make_runner(
            kafka,
            ledger_handler(engine, pg.tables, ledger, "second", calls),
            topic,
            group,
            claim_ids=False,
        )
        await asyncio.wait_for(second.run(until_idle=True), DEADLINE)
    finally:
        await engine.dispose()

    assert calls == [eid for eid, _ in events(30, 60)]
    assert sorted(applied(pg, ledger)) == [eid for eid, _ in events(0, 60)]
    assert stored(pg, group, topic) == (60, epoch + 1)
    assert await topics.committed(group, topic) == {0: 60}
    said = [r.getMessage() for r in caplog.records if "starts at" in r.getMessage()]
    assert any("offset 30: the database" in line for line in said), said


# What claim_ids changes


@pytest.mark.parametrize("claim_ids", [False, True], ids=["offsets-only", "with-claims"])
async def test_a_producers_copy_at_another_offset_and_a_failed_record(
    kafka: KafkaService, topics: Topics, pg: Any, claim_ids: bool
) -> None:
    """A producer that retried wrote e-0001 twice, at offsets 1 and 3. With claims the copy
    is answered DUPLICATE; offsets only, it is applied again (the guarantee table in
    docs/kafka.md says so). A FAILED record is recorded and dead-lettered either way, and
    the offset moves past it."""
    ledger = pg.create_ledger()
    topic = await topics.create("copies")
    group = "copies-" + topic
    stream = [
        ("e-0000", json.dumps({"n": 0}).encode()),
        ("e-0001", json.dumps({"n": 1}).encode()),
        ("e-0002", json.dumps({"n": 2, "fail": True}).encode()),
        ("e-0001", json.dumps({"n": 1}).encode()),
        ("e-0004", json.dumps({"n": 4}).encode()),
    ]
    await topics.produce_many(topic, stream)
    engine = pg.async_engine()
    try:
        runner = make_runner(
            kafka,
            ledger_handler(engine, pg.tables, ledger, "a"),
            topic,
            group,
            batch_size=2,
            claim_ids=claim_ids,
        )
        await asyncio.wait_for(runner.run(until_idle=True), DEADLINE)
    finally:
        await engine.dispose()

    once = ["e-0000", "e-0001", "e-0004"]
    assert sorted(applied(pg, ledger)) == (once if claim_ids else sorted([*once, "e-0001"]))
    assert runner.outcomes[Outcome.DUPLICATE] == (1 if claim_ids else 0)
    with pg.engine.connect() as conn:
        rows = conn.exec_driver_sql(
            f"SELECT message_id, outcome FROM {pg.name('processed_events')} ORDER BY 1"
        ).all()
    failed = [("e-0002", "failed")]
    # Offsets only, the copy applied behind the FAILED record in its chunk gets a record
    # (the offset waits before the FAILED one for its dead letter; read again, the copy
    # is answered by it).
    assert [tuple(r) for r in rows] == (
        sorted([*failed, *((m, "processed") for m in once)])
        if claim_ids
        else [("e-0001", "processed"), *failed]
    )
    dead = [dict(r.headers)["event_id"] for r in await topics.records(topic + ".dlq")]
    assert dead == [b"e-0002"]
    assert stored(pg, group, topic)[0] == 5
    assert await topics.committed(group, topic) == {0: 5}


async def test_a_bulk_handlers_poison_fails_alone_without_claims(
    kafka: KafkaService, topics: Topics, pg: Any
) -> None:
    """Offsets only, a bulk handler: the call that raises names no culprit, the chunk is
    halved until the poison is alone; it ends FAILED (recorded, dead-lettered), its
    chunk-mates are applied once each, and the offset is past all of them."""
    ledger = pg.create_ledger()
    topic = await topics.create("bulk")
    group = "bulk-" + topic
    stream = events(0, 8)
    stream[5] = ("e-0005", json.dumps({"n": 5, "fail": True}).encode())
    await topics.produce_many(topic, stream)
    engine = pg.async_engine()
    dedup = AsyncDeduplicator(engine, consumer="ledger", tables=pg.tables, retry=QUICK)
    calls: list[int] = []

    @dedup.bulk_handler
    async def apply(messages: list[Message], session: Any) -> None:
        calls.append(len(messages))
        for message in messages:
            data = message.json()
            if data.get("fail"):
                raise ValueError("poison")  # names no message: bisected
            await session.execute(
                text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', :n, :m)"),
                {"n": data["n"], "m": message.id},
            )

    try:
        runner = make_runner(kafka, apply, topic, group, batch_size=8, claim_ids=False)
        await asyncio.wait_for(runner.run(until_idle=True), DEADLINE)
    finally:
        await engine.dispose()
    mine = [eid for eid, _ in stream]
    assert sorted(applied(pg, ledger)) == [m for m in mine if m != "e-0005"]
    assert calls[0] == 8 and len(calls) > 2  # one call for the chunk, then the halves
    with pg.engine.connect() as conn:
        rows = conn.exec_driver_sql(
            f"SELECT message_id, outcome FROM {pg.name('processed_events')}"
        ).all()
    # The poison's record, and those of its chunk-mates applied behind it (the offset waits
    # before the poison for its dead letter: read again, they are answered by them).
    assert sorted(tuple(r) for r in rows) == [
        ("e-0005", "failed"),
        ("e-0006", "processed"),
        ("e-0007", "processed"),
    ]
    dead = [dict(r.headers)["event_id"] for r in await topics.records(topic + ".dlq")]
    assert dead == [b"e-0005"]
    assert stored(pg, group, topic)[0] == 8


async def test_a_chunk_of_refused_records_alone_moves_the_offset_too(
    kafka: KafkaService, topics: Topics, pg: Any
) -> None:
    """A record without an id (``coordinates_as_id=False``) is refused before any
    transaction: alone in its chunk nothing commits it, so the runner writes the offset
    past it itself (else a restart would refuse and dead-letter it again)."""
    ledger = pg.create_ledger()
    topic = await topics.create("refused")
    group = "refused-" + topic
    await topics.produce(topic, json.dumps({"n": 0}).encode(), event_id="e-0000")
    await topics.produce(topic, json.dumps({"n": 1}).encode())  # no event_id header
    engine = pg.async_engine()
    try:
        for _ in range(2):  # the second run, a restart, reads nothing again
            runner = make_runner(
                kafka,
                ledger_handler(engine, pg.tables, ledger, "a"),
                topic,
                group,
                batch_size=1,
                claim_ids=False,
                coordinates_as_id=False,
            )
            await asyncio.wait_for(runner.run(until_idle=True), DEADLINE)
    finally:
        await engine.dispose()
    assert applied(pg, ledger) == ["e-0000"]
    assert stored(pg, group, topic)[0] == 2
    assert len(await topics.records(topic + ".dlq")) == 1  # dead-lettered once, not twice


async def test_the_first_records_are_read_at_the_assignment_not_a_poll_timeout_later(
    kafka: KafkaService, topics: Topics, pg: Any
) -> None:
    """An assigned partition is paused until the loop takes it (its owner epoch, its
    stored offset); the fetch that was waiting for the assignment used to wait out its
    whole poll_timeout before the loop got to the take: here 40 s, at every start and
    rebalance. Now the assignment ends that wait: the records are applied well within it,
    and stop() ends the run promptly."""
    ledger = pg.create_ledger()
    topic = await topics.create("news")
    group = "news-" + topic
    engine = pg.async_engine()
    await topics.produce_many(topic, events(0, 20))
    runner = make_runner(
        kafka,
        ledger_handler(engine, pg.tables, ledger, "news"),
        topic,
        group,
        claim_ids=False,
        poll_timeout=timedelta(seconds=40),
    )
    running = asyncio.create_task(runner.run())
    try:
        await until(lambda: runner.ready, "the runner to join the group")
        loop = asyncio.get_running_loop()
        joined = loop.time()
        await until(lambda: len(applied(pg, ledger)) == 20, "the 20 records", timeout=30.0)
        assert loop.time() - joined < 30.0  # a poll_timeout (40 s) after the join: failed
        runner.stop()
        await asyncio.wait_for(running, 15.0)
    finally:
        if not running.done():
            running.cancel()
        await engine.dispose()
    assert sorted(applied(pg, ledger)) == [eid for eid, _ in events(0, 20)]
    assert stored(pg, group, topic)[0] == 20


@pytest.mark.parametrize("claim_ids", [False, True], ids=["offsets-only", "with-claims"])
async def test_a_first_record_failed_is_read_again_with_auto_offset_reset_latest(
    kafka: KafkaService, topics: Topics, pg: Any, claim_ids: bool
) -> None:
    """A partition's first chunk holds the offset at its first record, FAILED (its dead
    letter goes after the commit); killed in between. The database stores that record's
    offset, not nothing: restarted with ``auto_offset_reset="latest"`` and no group offset,
    the runner starts at it (it started at the log's end: the dead letter was never sent),
    dead-letters it once and applies nothing twice."""
    ledger = pg.create_ledger()
    topic = await topics.create("first-failed")
    group = "first-failed-" + topic
    await topics.produce(topic, json.dumps({"n": 0, "fail": True}).encode(), event_id="e-0000")
    await topics.produce_many(topic, events(1, 3))

    def crash(results: Sequence[Result]) -> None:
        raise SimulatedCrash("killed after the database commit, before the dead letter")

    engine = pg.async_engine()
    try:
        handle = ledger_handler(engine, pg.tables, ledger, "a")
        first = make_runner(
            kafka, handle, topic, group, before_ack=crash, claim_ids=claim_ids, batch_size=3
        )
        with pytest.raises(SimulatedCrash):
            await asyncio.wait_for(first.run(until_idle=True), DEADLINE)
        assert stored(pg, group, topic)[0] == 0  # held at the FAILED record
        again = make_runner(
            kafka,
            handle,
            topic,
            group,
            claim_ids=claim_ids,
            consumer_options={"auto_offset_reset": "latest"},
        )
        await asyncio.wait_for(again.run(until_idle=True), DEADLINE)
    finally:
        await engine.dispose()
    assert sorted(applied(pg, ledger)) == ["e-0001", "e-0002"]
    assert len(await topics.records(topic + ".dlq")) == 1
    assert stored(pg, group, topic)[0] == 3


async def test_a_take_that_fails_is_tried_again_a_poll_timeout_later_not_at_once(
    kafka: KafkaService, topics: Topics, pg: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database is away when the partition is assigned: the take (owner epoch, stored
    offset) fails, the partition stays paused, and it is taken again at the next fetch,
    a poll_timeout later. The assignment ends a fetch's wait once (``Ownership.news``); a
    take that failed must not end the next ones too, or the loop would spin on the
    database as fast as it answers. Once it is back, every record is applied once."""
    poll = 0.25
    failures: list[float] = []
    real_take = OffsetStore.take

    async def take(store: OffsetStore, partitions: Any) -> Any:
        if len(failures) < 4:
            failures.append(asyncio.get_running_loop().time())
            raise ConnectionError("the database is away (injected before the take)")
        return await real_take(store, partitions)

    monkeypatch.setattr(OffsetStore, "take", take)
    ledger = pg.create_ledger()
    topic = await topics.create("take-fails")
    group = "take-fails-" + topic
    await topics.produce_many(topic, events(0, 10))
    engine = pg.async_engine()
    try:
        runner = make_runner(
            kafka,
            ledger_handler(engine, pg.tables, ledger, "a"),
            topic,
            group,
            claim_ids=False,
            poll_timeout=timedelta(seconds=poll),
        )
        await asyncio.wait_for(runner.run(until_idle=True), DEADLINE)
    finally:
        await engine.dispose()
    assert len(failures) == 4
    # Three more tries, each after a fetch that waited (a spinning loop: milliseconds).
    assert failures[-1] - failures[0] >= 3 * poll * 0.8, failures
    assert sorted(applied(pg, ledger)) == [eid for eid, _ in events(0, 10)]
    assert stored(pg, group, topic)[0] == 10


async def test_the_collector_is_frozen_once_set_up_before_the_first_record(
    kafka: KafkaService, topics: Topics, pg: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner freezes the start-up objects (collector.freeze_once) after its set-up
    and before it handles anything, so the collector's full passes skip them."""
    from consumerdedup import collector

    order: list[str] = []
    monkeypatch.setattr(collector, "freeze_once", lambda: order.append("freeze") or True)
    ledger = pg.create_ledger()
    topic = await topics.create("frozen")
    for event_id, body in events(0, 2):
        await topics.produce(topic, body, event_id=event_id)
    engine = pg.async_engine()
    calls: list[str] = []
    handle = ledger_handler(engine, pg.tables, ledger, "a", calls)
    try:
        runner = make_runner(
            kafka, handle, topic, "frozen-" + topic, claim_ids=False,
            before_ack=lambda results: order.extend(r.message.id for r in results),
        )  # fmt: skip
        await asyncio.wait_for(runner.run(until_idle=True), DEADLINE)
    finally:
        await engine.dispose()
    assert order == ["freeze", "e-0000", "e-0001"]
    assert applied(pg, ledger) == ["e-0000", "e-0001"]


# What the operator sees


async def test_stats_shows_the_offsets_per_group_and_topic(pg: Any, cli: Cli) -> None:
    store = OffsetStore(pg.engine, pg.tables, "payments")
    taken = await store.take([("orders", 0), ("orders", 1)])
    fence = store.fence("orders", 1, taken["orders", 1], claims=False)
    assert await store.advance(fence, 41)
    await store.take([("orders", 1)])  # assigned again: its epoch is one more now
    assert not await store.advance(fence, 99)  # the old epoch's write changes nothing

    run = cli(pg, "stats", "--json")
    assert run.returncode == 0, run.stderr
    [group] = json.loads(run.stdout)["consumer_offsets"]["groups"]
    assert {k: group[k] for k in ("group", "topic", "partitions")} == {
        "group": "payments",
        "topic": "orders",
        "partitions": 2,
    }
    bumped = taken["orders", 1].epoch + 1  # the later of the two fresh rows, taken again
    assert (group["next_offsets_sum"], group["max_owner_epoch"]) == (41, bumped)
    table = cli(pg, "stats")
    assert "Kafka offsets in the database" in table.stdout and "payments" in table.stdout


if __name__ == "__main__":
    _kill_9_worker(sys.argv[1:])
