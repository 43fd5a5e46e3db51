"""stop(deadline) on the Kafka runner: past the deadline the chunk in flight is cancelled
(its transaction rolls back, its offset stays), run() returns, and the record comes again."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from consumerdedup import Message
from tests.kafka.test_runner import Ledger, body, runner
from tests.support.kafka_service import KafkaService, Topics, kafka_fixture, topics_fixture  # noqa: F401

DEADLINE = 0.5
LEAVING = 5.0
"""What closing may add after the deadline: leaving the group, stopping the producer."""


@pytest.fixture
async def ledger(pg: Any) -> AsyncIterator[Ledger]:
    found = Ledger(pg)
    yield found
    await found.close()


async def test_past_the_deadline_the_chunk_in_flight_is_cancelled_and_comes_again(
    kafka: KafkaService, topics: Topics, ledger: Ledger
) -> None:
    topic = await topics.create("deadline")
    await topics.produce(topic, body(1), event_id="m-1")
    entered = asyncio.Event()

    async def hang(message: Message) -> None:  # a handler that never returns by itself
        entered.set()
        await asyncio.Event().wait()

    ledger.before = hang
    stuck = runner(kafka, ledger.handle, topic)
    running = asyncio.create_task(stuck.run())
    await asyncio.wait_for(entered.wait(), 60)
    asked = time.monotonic()
    stuck.stop(deadline=DEADLINE)
    await asyncio.wait_for(running, DEADLINE + LEAVING)  # without the deadline: for ever
    assert time.monotonic() - asked >= DEADLINE
    assert ledger.applied() == [] and ledger.recorded() == set()
    assert await topics.lag("group-" + topic, topic) == 1

    ledger.before = None
    await runner(kafka, ledger.handle, topic).run(until_idle=True)
    assert ledger.applied() == ["m-1"]
    assert await topics.lag("group-" + topic, topic) == 0


async def test_without_a_deadline_stop_waits_for_the_chunk_in_flight(
    kafka: KafkaService, topics: Topics, ledger: Ledger
) -> None:
    topic = await topics.create("no-deadline")
    await topics.produce(topic, body(1), event_id="m-1")
    entered, release = asyncio.Event(), asyncio.Event()

    async def slow(message: Message) -> None:
        entered.set()
        await release.wait()

    ledger.before = slow
    consumer = runner(kafka, ledger.handle, topic)
    running = asyncio.create_task(consumer.run())
    await asyncio.wait_for(entered.wait(), 60)
    consumer.stop()
    done, _ = await asyncio.wait({running}, timeout=DEADLINE * 2)
    assert not done, "stop() without a deadline gave up the chunk in flight"
    release.set()
    await asyncio.wait_for(running, 30)
    assert ledger.applied() == ["m-1"]
    assert await topics.lag("group-" + topic, topic) == 0
