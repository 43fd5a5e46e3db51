"""Round 13 attacks on the Kafka runner with its offsets in the database: an assignment
ends the fetch that was waiting for it, stop() is seen every 0.1 s whatever poll_timeout.

On the real broker (Tansu, started by the fixtures) and PostgreSQL, ``claim_ids=False``:
the offset in the database is all that stands between a redelivery and a doubled ledger
row, so a skip or a double shows in the ledger.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest

from consumerdedup.adapters.kafka import KafkaConsumerRunner
from tests.kafka.test_offsets_in_database import (
    applied,
    events,
    ledger_handler,
    make_runner,
    until,
)
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)

pytestmark = pytest.mark.postgres

LONG = timedelta(seconds=30)


def runner_for(
    kafka: KafkaService, engine: Any, pg: Any, ledger: str, topic: str, who: str, **config: Any
) -> KafkaConsumerRunner:
    handle = ledger_handler(engine, pg.tables, ledger, who)
    return make_runner(kafka, handle, topic, "g-" + topic, claim_ids=False, **config)


def exactly_once(pg: Any, ledger: str, first: int, last: int) -> None:
    got = Counter(applied(pg, ledger))
    want = [eid for eid, _ in events(first, last)]
    doubled = sorted(k for k, n in got.items() if n > 1)
    missing = [e for e in want if e not in got]
    assert not doubled and not missing, (doubled, missing)


async def stopped(runner: KafkaConsumerRunner, task: asyncio.Task[Any], within: float) -> float:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    runner.stop()
    await asyncio.wait_for(task, within)
    return loop.time() - t0


async def test_stop_with_a_60s_poll_timeout_returns_promptly_when_idle(
    kafka: KafkaService, topics: Topics, pg: Any
) -> None:
    ledger = pg.create_ledger()
    topic = await topics.create("idle")
    engine = pg.async_engine()
    runner = runner_for(kafka, engine, pg, ledger, topic, "a", poll_timeout=timedelta(seconds=60))
    task = asyncio.create_task(runner.run())
    try:
        await topics.produce_many(topic, events(0, 3))
        await until(lambda: len(applied(pg, ledger)) == 3, "3 records", timeout=30)
        took = await stopped(runner, task, 10.0)
        assert took < 5.0, took
    finally:
        if not task.done():
            task.cancel()
        await engine.dispose()
    exactly_once(pg, ledger, 0, 3)


async def test_stop_right_after_start_with_a_60s_poll_timeout(
    kafka: KafkaService, topics: Topics, pg: Any
) -> None:
    """stop() while the runner is joining / taking its partitions."""
    ledger = pg.create_ledger()
    topic = await topics.create("early")
    engine = pg.async_engine()
    await topics.produce_many(topic, events(0, 5))
    runner = runner_for(kafka, engine, pg, ledger, topic, "a", poll_timeout=timedelta(seconds=60))
    task = asyncio.create_task(runner.run())
    try:
        await until(lambda: runner.ready, "the join", timeout=30)
        took = await stopped(runner, task, 15.0)
        assert took < 10.0, took
    finally:
        if not task.done():
            task.cancel()
    # Whatever was applied was applied once; a restart finishes the rest, nothing doubled.
    again = runner_for(kafka, engine, pg, ledger, topic, "b")
    try:
        await asyncio.wait_for(again.run(until_idle=True), 60)
    finally:
        await engine.dispose()
    exactly_once(pg, ledger, 0, 5)


async def test_two_members_started_together_with_a_long_poll_timeout(
    kafka: KafkaService, topics: Topics, pg: Any
) -> None:
    """Two runners of one group, 4 partitions, poll_timeout 30 s, started at once: each
    record applied exactly once, well before a poll_timeout; both stop promptly."""
    ledger = pg.create_ledger()
    topic = await topics.create("two", partitions=4)
    engine = pg.async_engine()
    await topics.produce_many(topic, events(0, 40), partitions=4)
    a = runner_for(kafka, engine, pg, ledger, topic, "a", poll_timeout=LONG)
    b = runner_for(kafka, engine, pg, ledger, topic, "b", poll_timeout=LONG)
    ta = asyncio.create_task(a.run())
    tb = asyncio.create_task(b.run())
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        await until(lambda: len(applied(pg, ledger)) >= 40, "40 records", timeout=50)
        assert loop.time() - t0 < LONG.total_seconds(), loop.time() - t0
        await topics.produce_many(topic, events(40, 60), partitions=4)
        await until(lambda: len(applied(pg, ledger)) >= 60, "60 records", timeout=25)
        assert await stopped(a, ta, 10.0) < 5.0
        assert await stopped(b, tb, 10.0) < 5.0
    finally:
        for t in (ta, tb):
            if not t.done():
                t.cancel()
        await engine.dispose()
    exactly_once(pg, ledger, 0, 60)
    # Both members took partitions (the 2nd wave, after both joined, is spread over 4).
    assert applied(pg, ledger, "a") and applied(pg, ledger, "b")


async def test_a_member_joins_and_leaves_mid_stream(
    kafka: KafkaService, topics: Topics, pg: Any
) -> None:
    """Records flow while a third member joins then leaves (two rebalances), poll_timeout
    30 s: nothing skipped, nothing doubled, the flow goes on within a poll_timeout."""
    ledger = pg.create_ledger()
    topic = await topics.create("flow", partitions=3)
    engine = pg.async_engine()
    a = runner_for(kafka, engine, pg, ledger, topic, "a", poll_timeout=LONG)
    b = runner_for(kafka, engine, pg, ledger, topic, "b", poll_timeout=LONG)
    tasks = [asyncio.create_task(a.run()), asyncio.create_task(b.run())]
    produced = 0

    async def produce(n: int) -> None:
        nonlocal produced
        await topics.produce_many(topic, events(produced, produced + n), partitions=3)
        produced += n

    try:
        await produce(30)
        await until(lambda: len(applied(pg, ledger)) >= 30, "first 30", timeout=50)
        c = runner_for(kafka, engine, pg, ledger, topic, "c", poll_timeout=LONG)
        tc = asyncio.create_task(c.run())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LONG.total_seconds()
        while not applied(pg, ledger, "c"):  # records flow until the newcomer applies one
            assert loop.time() < deadline, "c took no partition within a poll_timeout"
            await produce(3)
            await until(lambda: len(applied(pg, ledger)) >= produced, "flow", timeout=50)
        await produce(30)
        assert await stopped(c, tc, 10.0) < 5.0
        await produce(30)
        await until(lambda: len(applied(pg, ledger)) >= produced, "all", timeout=50)
        for r, t in ((a, tasks[0]), (b, tasks[1])):
            assert await stopped(r, t, 10.0) < 5.0
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await engine.dispose()
    exactly_once(pg, ledger, 0, produced)


class Proxy:
    """A TCP relay to PostgreSQL that the test can take down (every connection cut, new
    ones refused) and bring back up on the same port: the database down, not reconfigured."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.server: asyncio.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()
        self.accepted = 0

    async def up(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def down(self) -> None:
        assert self.server is not None
        self.server.close()
        for w in list(self.writers):
            w.transport.abort()
        self.writers.clear()
        await self.server.wait_closed()
        self.server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", 5432)
        except OSError:
            writer.transport.abort()
            return
        self.writers |= {writer, up_w}

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                w.transport.abort()
                self.writers.discard(w)

        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))


async def test_a_take_that_fails_with_the_database_down_is_taken_later(
    kafka: KafkaService, topics: Topics, pg: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Runner a consumes through a relay to the database; the database goes down; b joins
    (a rebalance: every take meets the database down). While it is down: no busy loop
    (CPU and log lines bounded) and nothing committed past what was processed. Once it is
    back: every record applied exactly once, by someone."""
    import logging
    import socket
    import time

    from sqlalchemy.engine import make_url
    from sqlalchemy.ext.asyncio import create_async_engine

    caplog.set_level(logging.DEBUG)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proxy = Proxy(port)
    await proxy.up()
    url = make_url(pg.async_url).set(host="127.0.0.1", port=port)
    engine = create_async_engine(url, pool_pre_ping=True)
    ledger = pg.create_ledger()
    topic = await topics.create("down", partitions=2)
    slow = {"poll_timeout": LONG, "retry_delay": timedelta(seconds=1)}
    a = runner_for(kafka, engine, pg, ledger, topic, "a", **slow)
    b = runner_for(kafka, engine, pg, ledger, topic, "b", **slow)
    ta = asyncio.create_task(a.run())
    tb: asyncio.Task[Any] | None = None
    try:
        await topics.produce_many(topic, events(0, 20), partitions=2)
        await until(lambda: len(applied(pg, ledger)) >= 20, "first 20", timeout=50)
        await proxy.down()
        await topics.produce_many(topic, events(20, 40), partitions=2)
        tb = asyncio.create_task(b.run())
        lines0 = len(caplog.records)
        cpu0, wall0 = time.process_time(), time.monotonic()
        await asyncio.sleep(3.0)  # a window to measure, not a wait for a condition
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        lines = len(caplog.records) - lines0
        assert cpu < 0.3 * wall, (cpu, wall)
        assert lines < 150, [r.getMessage()[:120] for r in caplog.records[lines0:]]
        assert len(applied(pg, ledger)) == 20
        committed = await topics.committed("g-" + topic, topic)
        assert sum(committed.values()) <= 20, committed
        await proxy.up()
        await until(lambda: len(applied(pg, ledger)) >= 40, "all 40 after", timeout=50)
        assert await stopped(a, ta, 10.0) < 5.0
        assert await stopped(b, tb, 10.0) < 5.0
    finally:
        for t in (ta, tb):
            if t is not None and not t.done():
                t.cancel()
        await engine.dispose()
        if proxy.server is not None:
            await proxy.down()
    exactly_once(pg, ledger, 0, 40)
