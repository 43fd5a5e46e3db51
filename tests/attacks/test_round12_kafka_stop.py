"""Round 12: stop() while a group rebalance is held at the broker, mid-run.

A rebalance begun between the runner's first getmany (which returned records) and the
getmany calls that take the other partitions' buffered records: aiokafka's getmany waits
for the next assignment whatever its timeout, and the join lasts until every member has
rejoined (a frozen one: its whole session). Only the first getmany was stoppable and
ticking; the others held stop() (and ``last_tick``) for the frozen member's session.

The interleaving is forced: the first getmany that returns a record does not return it
until a new member has started a rebalance and this runner has sent its JoinGroup.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from typing import Any

import pytest

from consumerdedup.adapters.kafka import KafkaConsumerRunner
from tests.kafka.test_runner import Ledger, body, runner
from tests.support.kafka_joins import assigned, freeze, join_sent_fixture, members_fixture  # noqa: F401
from tests.support.kafka_service import KafkaService, Topics, kafka_fixture, topics_fixture  # noqa: F401

RETURNS_WITHIN = 30.0
"""run() returns within this after stop(): the close bound (10 s) plus slack, and half the
frozen member's session."""

GONE_MEMBERS_DROPPED_WITHIN = 400.0
"""Seconds within which the broker drops members gone without a LeaveGroup: the frozen
member's session, and the rebalance timeout of a join left pending (aiokafka's default
max_poll_interval_ms, 300 s, bounds it)."""


@pytest.fixture
async def ledger(pg: Any) -> AsyncIterator[Ledger]:
    found = Ledger(pg)
    yield found
    await found.close()


async def _until(condition: Any, running: asyncio.Task[None]) -> None:
    while not condition():
        assert not running.done(), running
        await asyncio.sleep(0.01)  # polling a condition


@pytest.mark.parametrize("offsets", ["broker", "database"])
async def test_stop_while_a_rebalance_holds_the_other_partitions_getmany_returns(
    kafka: KafkaService,
    topics: Topics,
    ledger: Ledger,
    members: Any,
    offsets: str,
    join_sent: asyncio.Event,
) -> None:
    topic = await topics.create("midrun", partitions=4)
    group = "group-" + topic
    frozen = members(kafka, topic, group)
    assigned(frozen)

    consuming = runner(kafka, ledger.handle, topic, group_id=group, offsets=offsets)
    running = asyncio.create_task(consuming.run())
    # Joined beside the live member: each holds two of the four partitions.
    await asyncio.wait_for(
        _until(lambda: consuming.ready and len(consuming.consumer.assignment()) == 2, running), 60
    )
    freeze(frozen)  # from now on it holds every join for its session
    consumer = consuming.consumer
    mine = min(consumer.assignment())
    joins = join_sent
    joins.clear()  # its first join is done (ready): what comes next is the rejoin
    original = consumer.getmany
    in_the_other_getmany = asyncio.Event()
    triggered = False

    async def getmany(*partitions: Any, **options: Any) -> Any:
        nonlocal triggered
        if partitions:  # a getmany for one of the other partitions, after the first
            in_the_other_getmany.set()
            return await original(*partitions, **options)
        got = await original(**options)
        if got and not triggered:
            # Forced: the rebalance begins before this fetch's records are returned.
            triggered = True
            members(kafka, topic, group)  # a new member: a rebalance the frozen one holds
            await joins.wait()  # this runner rejoins: its next getmany waits for the join
        return got

    consumer.getmany = getmany
    await topics.produce(topic, body(1), event_id="m-1", partition=mine.partition)
    await asyncio.wait_for(in_the_other_getmany.wait(), 60)
    held_since = consuming.last_tick
    # Alive while held: the loop's tick moves (it stood still for the frozen session).
    await asyncio.wait_for(_until(lambda: consuming.last_tick != held_since, running), 20)
    consuming.stop()
    # Before: that getmany waited for the join, deaf to stop(), for the frozen session.
    await asyncio.wait_for(running, RETURNS_WITHIN)
    assert not consuming.ready
    assert ledger.applied() == [] and ledger.recorded() == set()  # stopped: nothing handled
    assert await topics.lag(group, topic) == 1  # nothing committed: the record is kept


@pytest.mark.slow  # the second runner waits for the broker to drop both members (~2 min)
async def test_stopped_until_idle_then_a_second_runner_in_the_same_loop_takes_everything(
    kafka: KafkaService, topics: Topics, ledger: Ledger, members: Any, join_sent: asyncio.Event
) -> None:
    """run(until_idle=True) whose first join a frozen member holds: stop() returns it with
    nothing handled (its close cut short: it stays a member until its session ends). A
    second runner of the group in the same event loop (after the first's connections were
    closed under it) then waits for its first assignment, and handles each record once
    when the frozen member's session and the first runner's have ended."""
    topic = await topics.create("idle", partitions=2)
    group = "group-" + topic
    frozen = members(kafka, topic, group)
    assigned(frozen)
    freeze(frozen)
    for n, partition in enumerate([0, 1, 0], start=1):
        await topics.produce(topic, body(n), event_id=f"m-{n}", partition=partition)

    joins = join_sent
    first = runner(kafka, ledger.handle, topic, group_id=group)
    running = asyncio.create_task(first.run(until_idle=True))
    await asyncio.wait_for(_until(joins.is_set, running), 60)
    ticked = first.last_tick
    await asyncio.wait_for(_until(lambda: first.last_tick != ticked, running), 20)
    assert not first.ready
    first.stop()
    await asyncio.wait_for(running, RETURNS_WITHIN)
    assert ledger.applied() == [] and await topics.lag(group, topic) == 3

    frozen.kill()  # gone, but a member until its session ends: the next join waits for it
    second = runner(kafka, ledger.handle, topic, group_id=group)
    # Bounded by how long the broker keeps the two members gone without a LeaveGroup (the
    # frozen one's session, the first runner's join: ~130 s on Tansu), not a race.
    await asyncio.wait_for(second.run(until_idle=True), GONE_MEMBERS_DROPPED_WITHIN)
    assert sorted(ledger.applied()) == ["m-1", "m-2", "m-3"]
    assert await topics.lag(group, topic) == 0


@pytest.fixture
def silent_broker() -> Iterator[tuple[str, threading.Event]]:
    """A port that accepts connections and never answers (a broker hung, or a black hole
    in the network): its address, and an event set once a client has connected."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    connected = threading.Event()
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(listener.accept()[0])
                connected.set()

    threading.Thread(target=accept, daemon=True).start()
    yield f"127.0.0.1:{listener.getsockname()[1]}", connected
    listener.close()
    for sock in held:
        sock.close()


async def test_stop_while_the_consumer_starts_on_a_broker_that_does_not_answer(
    kafka: KafkaService, ledger: Ledger, silent_broker: tuple[str, threading.Event]
) -> None:
    """stop() (SIGTERM) before the join: the consumer's start() waits on its bootstrap
    metadata request, up to aiokafka's request timeout (40 s); run() returns within the
    close bound of stop() all the same, committing nothing."""
    address, connected = silent_broker
    starting = KafkaConsumerRunner(
        ledger.handle,
        "never-read",
        bootstrap_servers=address,
        group_id="group-never",
        config=kafka.config(poll_timeout=timedelta(milliseconds=100)),
    )
    running = asyncio.create_task(starting.run())
    await asyncio.wait_for(_until(connected.is_set, running), 60)
    starting.stop()
    await asyncio.wait_for(running, RETURNS_WITHIN / 2)
    assert not starting.ready and ledger.applied() == []
