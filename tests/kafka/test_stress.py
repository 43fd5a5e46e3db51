"""The Kafka runner under fire: duplicates, rebalances, killed runners, crashes, database outages.

Every test ends by checking what matters: one business row per distinct id,
one processed_events row per id, and offsets committed to the end of every
partition (nothing left unconsumed). Run as a script, this module is the
runner process that ``test_a_runner_process_killed_mid_stream...`` kills.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from consumerdedup import (
    AsyncDeduplicator,
    Message,
    Outcome,
    Result,
    RetryPolicy,
    SimulatedCrash,
    Tables,
)
from consumerdedup.adapters.kafka import KafkaConfig, KafkaConsumerRunner
from tests.support.kafka_service import KafkaService, Topics, kafka_fixture, topics_fixture  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
QUICK_RETRY = RetryPolicy(attempts=2, initial_delay=timedelta(0), max_delay=timedelta(0))


def handler(
    engine: AsyncEngine,
    tables: Tables,
    ledger: str,
    *,
    who: str = "a",
    pause: float = 0.0,
    **options: Any,
) -> Any:
    dedup = AsyncDeduplicator(engine, consumer="ledger", tables=tables, **options)

    @dedup.handler
    async def handle(message: Message, session: Any) -> None:
        if pause:
            await asyncio.sleep(pause)
        await session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES (:who, :n, :m)"),
            {"who": who, "n": message.json()["n"], "m": message.id},
        )

    return handle


def two_runners(
    kafka: KafkaService, engine: AsyncEngine, pg: Any, ledger: str, topic: str, group: str
) -> tuple[KafkaConsumerRunner, KafkaConsumerRunner]:
    """Two members of one group, writing as 'first' and 'second', slow enough to overlap."""
    first, second = (
        make_runner(
            kafka,
            kafka.bootstrap,
            handler(engine, pg.tables, ledger, who=who, pause=0.002),
            topic,
            group,
            batch_size=20,
        )
        for who in ("first", "second")
    )
    return first, second


def make_runner(
    kafka_or_config: KafkaService | KafkaConfig,
    bootstrap: str,
    handle: Any,
    topic: str,
    group: str,
    before_ack: Callable[[Sequence[Result]], None] | None = None,
    **config: Any,
) -> KafkaConsumerRunner:
    if isinstance(kafka_or_config, KafkaService):
        options = {"poll_timeout": timedelta(milliseconds=100), "retry_delay": timedelta(0)}
        kafka_or_config = kafka_or_config.config(**{**options, **config})
    return KafkaConsumerRunner(
        handle,
        topic,
        bootstrap_servers=bootstrap,
        group_id=group,
        config=kafka_or_config,
        before_ack=before_ack,
    )


async def wait_for(
    condition: Callable[[], Awaitable[bool]], what: str, timeout: float = 90
) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def split_between(*runners: KafkaConsumerRunner, partitions: int = 4) -> bool:
    """Every runner owns partitions, and together all of them: the group's rebalance is done."""
    owned = [r.consumer.assignment() if r.consumer is not None else set() for r in runners]
    return all(owned) and sum(map(len, owned)) == partitions


async def drained(topics: Topics, group: str, topic: str) -> bool:
    return await topics.lag(group, topic) == 0


def count(pg: Any, sql: str) -> int:
    return int(pg.scalar(sql))  # type: ignore[call-overload]


def assert_exactly_once(pg: Any, ledger: str, expected: set[str]) -> None:
    with pg.engine.connect() as conn:
        applied = [r[0] for r in conn.exec_driver_sql(f"SELECT message_id FROM {ledger}")]
        recorded = [
            r[0]
            for r in conn.exec_driver_sql(f"SELECT message_id FROM {pg.name('processed_events')}")
        ]
    assert len(applied) == len(expected), f"{len(applied)} effects for {len(expected)} ids"
    assert set(applied) == expected
    assert sorted(recorded) == sorted(expected)


def payloads(total: int, twice: float, seed: int) -> tuple[list[tuple[str, bytes]], set[str]]:
    """``total`` distinct events, a share of them produced a second time later on."""
    rng = random.Random(seed)
    events = [(f"e-{i:05d}", json.dumps({"n": i}).encode()) for i in range(total)]
    stream = events + rng.sample(events, int(total * twice))
    rng.shuffle(stream)
    return stream, {eid for eid, _ in events}


@pytest.mark.slow
async def test_5000_records_30_percent_produced_twice_have_5000_effects(
    kafka: KafkaService, topics: Topics, pg: Any
) -> None:
    ledger = pg.create_ledger()
    engine = pg.async_engine()
    topic = await topics.create("bulk", partitions=4)
    stream, expected = payloads(5000, 0.3, seed=1)
    await topics.produce_many(topic, stream, partitions=4)
    group = "bulk-" + topic
    handle = handler(engine, pg.tables, ledger)
    run = make_runner(kafka, kafka.bootstrap, handle, topic, group, batch_size=250)
    await run.run(until_idle=True)
    await engine.dispose()

    assert_exactly_once(pg, ledger, expected)
    assert run.outcomes[Outcome.PROCESSED] == 5000
    assert run.outcomes[Outcome.DUPLICATE] == 1500
    ends = await topics.ends(topic)
    assert sum(ends.values()) == 6500
    assert await topics.committed(group, topic) == ends


async def test_two_runners_one_cancelled_mid_stream_the_other_takes_over(
    kafka: KafkaService, topics: Topics, pg: Any
) -> None:
    ledger = pg.create_ledger()
    engine = pg.async_engine()
    topic = await topics.create("cancel", partitions=4)
    stream, expected = payloads(1500, 0.2, seed=2)
    group = "cancel-" + topic
    first, second = two_runners(kafka, engine, pg, ledger, topic, group)
    first_task = asyncio.create_task(first.run())
    second_task = asyncio.create_task(second.run())
    # The stream comes once the two share the partitions: a runner that joined late could
    # otherwise find the stream consumed, and 'both consuming' would wait out its guard.
    await wait_for(lambda: split_between(first, second), "the two runners to share the topic")
    await topics.produce_many(topic, stream, partitions=4)
    await wait_for(
        lambda: _true(
            count(pg, f"SELECT count(*) FROM {ledger} WHERE account = 'first'") >= 100
            and count(pg, f"SELECT count(*) FROM {ledger} WHERE account = 'second'") >= 100
        ),
        "both runners to be consuming",
    )
    first_task.cancel()  # killed wherever it is: mid-transaction, between commits, polling
    with pytest.raises(asyncio.CancelledError):
        await first_task
    await wait_for(lambda: drained(topics, group, topic), "the survivor to finish the stream")
    second.stop()
    await asyncio.wait_for(second_task, 30)
    await engine.dispose()

    assert_exactly_once(pg, ledger, expected)


@pytest.mark.slow
async def test_a_runner_process_killed_mid_stream_loses_nothing_and_doubles_nothing(
    kafka: KafkaService, topics: Topics, pg: Any
) -> None:
    ledger = pg.create_ledger()
    engine = pg.async_engine()
    topic = await topics.create("kill", partitions=4)
    stream, expected = payloads(1500, 0.2, seed=3)
    # Half the stream before the kill, half after: the worker, alone in the group at first,
    # consumes by construction, and the survivor has records left to take over.
    half = len(stream) // 2
    await topics.produce_many(topic, stream[:half], partitions=4)
    group = "kill-" + topic
    options = json.dumps(dict(kafka.group_options))
    command = [sys.executable, "-m", "tests.kafka.test_stress", kafka.bootstrap, topic, group]
    command += [pg.async_url, pg.schema, ledger, options, str(int(kafka.idempotence))]
    worker = subprocess.Popen(command, cwd=ROOT)
    try:
        await wait_for(
            lambda: _true(
                count(pg, f"SELECT count(*) FROM {ledger} WHERE account = 'worker'") >= 150
            ),
            "the worker process to be consuming",
        )
        survivor = make_runner(
            kafka,
            kafka.bootstrap,
            handler(engine, pg.tables, ledger, who="survivor", pause=0.002),
            topic,
            group,
            batch_size=20,
        )
        task = asyncio.create_task(survivor.run())
        await wait_for(  # the worker holds the other partitions, perhaps mid-batch
            lambda: _true(survivor.consumer is not None and bool(survivor.consumer.assignment())),
            "the survivor to join the worker's group",
        )
        worker.send_signal(signal.SIGKILL)  # no goodbye to the group, no last commit
        assert worker.wait(30) == -signal.SIGKILL
        await topics.produce_many(topic, stream[half:], partitions=4)
        await wait_for(lambda: drained(topics, group, topic), "the survivor to finish the stream")
        survivor.stop()
        await asyncio.wait_for(task, 30)
    finally:
        if worker.poll() is None:
            worker.kill()
        await engine.dispose()

    assert_exactly_once(pg, ledger, expected)
    assert count(pg, f"SELECT count(*) FROM {ledger} WHERE account = 'survivor'") > 0


async def test_a_runner_joining_mid_stream_takes_partitions_cleanly(
    kafka: KafkaService, topics: Topics, pg: Any
) -> None:
    ledger = pg.create_ledger()
    engine = pg.async_engine()
    topic = await topics.create("join", partitions=4)
    events = [(f"e-{i:05d}", json.dumps({"n": i}).encode()) for i in range(1200)]
    await topics.produce_many(topic, events[:800], partitions=4)
    group = "join-" + topic
    first, second = two_runners(kafka, engine, pg, ledger, topic, group)
    first_task = asyncio.create_task(first.run())
    await wait_for(lambda: _true(count(pg, f"SELECT count(*) FROM {ledger}") >= 200), "progress")
    second_task = asyncio.create_task(second.run())  # a rebalance while a batch is in flight
    # The rest once the second owns partitions: it gets records by construction (the first
    # could otherwise finish the stream before the rebalance, as on a loaded machine).
    await wait_for(lambda: split_between(first, second), "the two runners to share the topic")
    await topics.produce_many(topic, events[800:], partitions=4)
    await wait_for(lambda: drained(topics, group, topic), "both runners to finish the stream")
    first.stop()
    second.stop()
    await asyncio.wait_for(asyncio.gather(first_task, second_task), 30)
    await engine.dispose()

    assert_exactly_once(pg, ledger, {eid for eid, _ in events})
    assert second.outcomes[Outcome.PROCESSED] > 0, "the second runner never got a partition"
    # Each batch committed its offsets before its partition moved: nothing came twice.
    assert first.outcomes[Outcome.DUPLICATE] + second.outcomes[Outcome.DUPLICATE] == 0


async def test_a_crash_between_the_database_and_the_offset_commit_is_answered_duplicate(
    kafka: KafkaService, topics: Topics, pg: Any
) -> None:
    ledger = pg.create_ledger()
    engine = pg.async_engine()
    topic = await topics.create("crash", partitions=2)
    events = [(f"e-{i:04d}", json.dumps({"n": i}).encode()) for i in range(300)]
    await topics.produce_many(topic, events, partitions=2)
    group = "crash-" + topic
    batches: list[list[str]] = []

    def die_on_third(results: Sequence[Result]) -> None:
        batches.append([r.message.id for r in results])
        if len(batches) == 3:
            raise SimulatedCrash("killed after the database commit, before the offset commit")

    handle = handler(engine, pg.tables, ledger)
    # One chunk in flight: the crash then falls between exactly one batch's database commit
    # and its offset commit (with more, a sibling's commit may land as the crash cancels it;
    # test_concurrent_partitions has that case).
    crashing = make_runner(
        kafka,
        kafka.bootstrap,
        handle,
        topic,
        group,
        die_on_third,
        batch_size=25,
        partitions_in_flight=1,
    )
    with pytest.raises(SimulatedCrash):
        await crashing.run(until_idle=True)
    crashed = batches[-1]
    assert count(pg, f"SELECT count(*) FROM {ledger}") == sum(map(len, batches))  # committed
    committed = await topics.committed(group, topic)
    assert sum(committed.values()) == sum(map(len, batches[:2]))  # the last one never was

    answered: list[str] = []

    def duplicates(results: Sequence[Result]) -> None:
        answered.extend(r.message.id for r in results if r.outcome is Outcome.DUPLICATE)

    restarted = make_runner(kafka, kafka.bootstrap, handle, topic, group, duplicates, batch_size=25)
    await restarted.run(until_idle=True)
    await engine.dispose()

    assert sorted(answered) == sorted(crashed)  # redelivered, answered from processed_events
    assert_exactly_once(pg, ledger, {eid for eid, _ in events})
    assert await topics.committed(group, topic) == await topics.ends(topic)


async def test_database_connections_killed_mid_stream_are_retried_and_lose_nothing(
    kafka: KafkaService, topics: Topics, pg: Any
) -> None:
    """Kills land mid-transaction by construction: at each cue id's first delivery the
    handler, its INSERT done, has every connection of the runner terminated (and waits for
    it: ``pg_terminate_backend``'s timeout). A killer on a 0.25 s timer could hit nothing
    when its shots fell in a retry's pause, and 'at least 3 kills' rested on luck."""
    ledger = pg.create_ledger()
    victim = f"cdd-kafka-victim-{uuid.uuid4().hex[:8]}"
    engine = create_async_engine(pg.async_url, connect_args={"application_name": victim})
    topic = await topics.create("outage", partitions=3)
    stream, expected = payloads(1200, 0.1, seed=4)
    await topics.produce_many(topic, stream, partitions=3)
    group = "outage-" + topic
    cues = {"e-00007", "e-00300", "e-00301", "e-00642", "e-00900", "e-01199"}
    cue_ids = sorted(cues)
    calls: list[str] = []
    kills: list[int] = []

    def kill_every_connection() -> int:
        return count(
            pg,
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 10000)) "
            f"FROM pg_stat_activity WHERE application_name = '{victim}'",
        )

    dedup = AsyncDeduplicator(engine, consumer="ledger", tables=pg.tables)

    @dedup.handler
    async def handle(message: Message, session: Any) -> None:
        await session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', :n, :m)"),
            {"n": message.json()["n"], "m": message.id},
        )
        calls.append(message.id)
        if message.id in cues:  # once: its retry runs through
            cues.discard(message.id)
            kills.append(await asyncio.to_thread(kill_every_connection))

    run = make_runner(
        kafka,
        kafka.bootstrap,
        handle,
        topic,
        group,
        batch_size=20,
        retry_delay=timedelta(milliseconds=100),
        max_retry_delay=timedelta(milliseconds=100),
    )
    task = asyncio.create_task(run.run())
    await wait_for(lambda: drained(topics, group, topic), "the runner to finish the stream")
    run.stop()
    await asyncio.wait_for(task, 30)
    await engine.dispose()

    assert len(kills) == 6 and min(kills) >= 1, kills  # each cue killed its own connection
    assert all(calls.count(mid) >= 2 for mid in cue_ids), calls  # mid-transaction: run again
    assert_exactly_once(pg, ledger, expected)
    assert await topics.records(topic + ".dlq") == []


async def _true(value: bool) -> bool:
    return value


async def _worker(argv: list[str]) -> None:
    """The runner process the kill test starts, then SIGKILLs."""
    bootstrap, topic, group, url, schema, ledger, group_options, idempotence = argv
    engine = create_async_engine(url)
    tables = Tables.define(f"{schema}.processed_events", f"{schema}.outbox")
    config = KafkaConfig(
        batch_size=20,
        poll_timeout=timedelta(milliseconds=100),
        idempotent_producer=idempotence == "1",
        consumer_options=json.loads(group_options),
    )
    handle = handler(engine, tables, ledger, who="worker", pause=0.002)
    await make_runner(config, bootstrap, handle, topic, group).run()


if __name__ == "__main__":
    asyncio.run(_worker(sys.argv[1:]))
