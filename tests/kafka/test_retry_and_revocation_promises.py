"""KafkaConsumerRunner promises about RETRYs and rebalances that other tests could not see broken.

- a RETRY inside a fetch of several partitions sends only its own partition back: the
  other partitions' fetched records are handled, each once, and no offset moves past a
  record that was not decided;
- ``retry_delay`` doubles per RETRY of the same record in a row, up to ``max_retry_delay``
  (the only other test sets the two equal, so a constant delay passed it);
- a revocation waits for the batch in flight: a member joining while a handler is blocked
  gets no partition until that batch has committed, so nothing is handled twice.

On the real broker (Tansu) and PostgreSQL; each wait is on a condition with a deadline,
and a runner that stops making progress fails in seconds, saying where it stood.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from consumerdedup import Message, Outcome, Result, RetryLater, RetryPolicy
from consumerdedup.adapters.kafka import KafkaConsumerRunner
from tests.kafka.test_runner import Ledger, body, runner
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)

pytestmark = pytest.mark.postgres

ONCE = RetryPolicy(attempts=1, initial_delay=timedelta(0), max_delay=timedelta(0))
"""No in-process retry: a RetryLater is a RETRY at once, so the runner's pause is all there is."""
STALL = 30.0
"""Seconds without a new effect after which a runner is taken as stuck (a healthy one here
applies hundreds of records a second). A hang guard, not a throughput bound: a rebalance on
a loaded 2-core machine may pause the effects for seconds (it was 8 s); records dropped
from a fetch leave the group lagging forever, which this still fails."""


async def run_until_idle(
    run: KafkaConsumerRunner, progress: Callable[[], int], state: Callable[[], Any]
) -> None:
    """``run.run(until_idle=True)``; fails within STALL seconds once ``progress()`` stops
    moving (records dropped from a fetch leave the group lagging forever), with ``state()``."""
    task = asyncio.create_task(run.run(until_idle=True))
    seen, since = progress(), time.monotonic()
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.1)
            now = progress()
            if now != seen:
                seen, since = now, time.monotonic()
            assert time.monotonic() - since < STALL, f"no progress for {STALL} s: {state()}"
        await task
    finally:
        if not task.done():
            run.stop()
            await asyncio.wait_for(task, 30)


@pytest.fixture
async def ledger(pg: Any) -> Any:
    ledger = Ledger(pg, retry=ONCE)
    yield ledger
    await ledger.close()


async def test_a_retry_in_a_fetch_of_several_partitions_sends_back_only_its_own_partition(
    kafka: KafkaService, topics: Topics, ledger: Ledger
) -> None:
    """Fewer records per partition than batch_size: the first fetch holds all three
    partitions (max_records is batch_size per assigned partition). Its first record is a
    RETRY; the other partitions of that fetch must still be handled, and each partition's
    offset commits only what was decided."""
    partitions, each = 3, 8
    topic = await topics.create("fetch", partitions=partitions)
    ids = [f"m-{i:02d}" for i in range(partitions * each)]
    records = [(mid, body(i)) for i, mid in enumerate(ids)]
    await topics.produce_many(topic, records, partitions=partitions)
    handled: list[tuple[int, int]] = []

    async def before(message: Message) -> None:
        assert message.partition is not None and message.offset is not None
        handled.append((message.partition, message.offset))
        if len(handled) == 1:
            raise RetryLater("once")

    ledger.before = before
    run = runner(kafka, ledger.handle, topic, batch_size=10)

    def state() -> str:
        return f"{len(ledger.applied())} of {len(ids)} applied, handled {handled}"

    await run_until_idle(run, lambda: len(handled), state)

    retried, _ = handled[0]
    back = handled.index((retried, 0), 1)  # where the retried partition was read again
    others = {p for p, _ in handled[1:back]}
    assert others, f"the fetch held one partition only, the test proves nothing: {handled}"
    applied = ledger.applied()
    assert sorted(applied) == ids, state()  # each once, none dropped
    # The retried record and those behind it in its chunk are RETRY: as many as the first
    # fetch held of that partition, which is the broker's doing (all 8 mostly; 2 was seen).
    assert set(run.outcomes) == {Outcome.PROCESSED, Outcome.RETRY}, run.outcomes
    assert run.outcomes[Outcome.PROCESSED] == len(ids)
    assert 1 <= run.outcomes[Outcome.RETRY] <= each, run.outcomes
    for partition in range(partitions):  # each in offset order, the retried one from 0 again
        offsets = [o for p, o in handled if p == partition]
        assert offsets == [0] * (partition == retried) + list(range(each)), partition
    committed = await topics.committed("group-" + topic, topic)
    assert committed == dict.fromkeys(range(partitions), each)


async def test_the_retry_delay_doubles_per_retry_of_a_record_up_to_max_retry_delay(
    kafka: KafkaService, topics: Topics, ledger: Ledger
) -> None:
    topic = await topics.create("backoff")
    await topics.produce(topic, body(1), event_id="m-1")
    arrivals: list[float] = []

    async def before(message: Message) -> None:
        arrivals.append(time.monotonic())
        if len(arrivals) <= 6:
            raise RetryLater("not yet")

    ledger.before = before
    delays = {"retry_delay": timedelta(milliseconds=50), "max_retry_delay": timedelta(seconds=0.2)}
    # aiokafka's fetch_max_wait_ms (500 ms by default) delays the fetch after a resume: with
    # it, every pause below 0.5 s lasted 0.5 s (measured: 0.49-0.50 s gaps for 50-200 ms).
    fetch_fast = {"fetch_max_wait_ms": 20}
    run = runner(kafka, ledger.handle, topic, consumer_options=fetch_fast, **delays)
    await run_until_idle(run, lambda: len(arrivals), lambda: f"m-1 read at {arrivals}")

    pauses = [0.05, 0.1, 0.2, 0.2, 0.2, 0.2]  # doubled, then capped; no jitter
    gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
    assert len(gaps) == len(pauses), gaps
    # Exact lower bounds: the pause starts after the handler's clock read and the record is
    # read again only once it is over, so a delay that does not double fails here.
    shorter = any(gap < pause for gap, pause in zip(gaps, pauses, strict=True))
    assert not shorter, f"gaps {gaps}, pauses {pauses}: the delay did not double"
    # Upper bounds: the pause plus 0.3 s for the seek, the fetch and the handler's
    # transaction. Without the cap the pauses would go on 0.4, 0.8, 1.6 s.
    longer = any(gap >= pause + 0.3 for gap, pause in zip(gaps, pauses, strict=True))
    assert not longer, f"gaps {gaps}, pauses {pauses}: max_retry_delay did not cap the delay"
    assert run.outcomes == {Outcome.RETRY: 6, Outcome.PROCESSED: 1}
    assert ledger.applied() == ["m-1"]


async def test_a_revocation_waits_for_the_batch_in_flight(
    kafka: KafkaService, topics: Topics, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A's handler is held inside its first batch; B joins the group, which revokes A's
    partitions. The revocation must return only after that batch has committed: A's
    offset commit then still counts, B starts behind it, and nothing runs twice."""
    topic = await topics.create("revoke", partitions=2)
    ids = [f"m-{i:02d}" for i in range(40)]
    await topics.produce_many(topic, [(mid, body(i)) for i, mid in enumerate(ids)], partitions=2)
    group = "group-" + topic
    held, release = asyncio.Event(), asyncio.Event()
    first_batch: list[str] = []

    async def before(message: Message) -> None:
        if not held.is_set():
            held.set()
            await release.wait()  # the batch in flight, until the revocation has begun

    def settled(results: list[Result]) -> None:
        if not first_batch:
            first_batch.extend(r.message.id for r in results)

    ledger.before = before
    first = runner(kafka, ledger.handle, topic, group_id=group, batch_size=5, before_ack=settled)
    second = runner(kafka, ledger.handle, topic, group_id=group, batch_size=5)
    revoking, revoked = asyncio.Event(), asyncio.Event()
    batch_ended_when_revoked: list[bool] = []
    revoke = first._revoked  # the runner's rebalance listener calls it

    async def watched(partitions: Any) -> None:
        if not held.is_set():  # aiokafka's first join revokes nothing: not the one watched
            await revoke(partitions)
            return
        revoking.set()
        await revoke(partitions)
        batch_ended_when_revoked.append(bool(first_batch))
        revoked.set()

    monkeypatch.setattr(first, "_revoked", watched)
    tasks = [asyncio.create_task(first.run())]
    try:
        await asyncio.wait_for(held.wait(), 30)
        tasks.append(asyncio.create_task(second.run()))  # joins: A's partitions are revoked
        await asyncio.wait_for(revoking.wait(), 30)
        release.set()
        await asyncio.wait_for(revoked.wait(), 30)
        assert batch_ended_when_revoked == [True], "the revocation did not wait for the batch"
        deadline = time.monotonic() + 60
        while sorted(ledger.applied()) != ids:
            assert time.monotonic() < deadline, f"{len(ledger.applied())} of {len(ids)} applied"
            await asyncio.sleep(0.05)
        while await topics.lag(group, topic):
            assert time.monotonic() < deadline, await topics.committed(group, topic)
    finally:
        release.set()
        first.stop()
        second.stop()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)

    assert len(ledger.applied()) == len(ids)  # each once
    assert first.outcomes[Outcome.DUPLICATE] + second.outcomes[Outcome.DUPLICATE] == 0
    assert second.outcomes[Outcome.PROCESSED] > 0, "the second runner never got a partition"
