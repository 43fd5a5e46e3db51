"""stop() while the group join is held at the broker: run() returns, bounded.

A JoinGroup is answered once every member of the group has rejoined; a member that is
alive but frozen (here SIGSTOPped, as a process stuck in a long GC pause or a blocked
event loop is) holds every join until its session times out. The runner used to
subscribe before ``consumer.start()``, which then waited for the first assignment, deaf to
stop(); its getmany waits for the assignment too, whatever its timeout; and its close
waited for the join. Seen in a CI run of the chaos test: a role
restarted into such a rebalance did not stop within 15 s of SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.kafka.test_runner import Ledger, body, runner
from tests.support.kafka_joins import assigned, freeze, join_sent_fixture, members_fixture  # noqa: F401
from tests.support.kafka_service import KafkaService, Topics, kafka_fixture, topics_fixture  # noqa: F401

RETURNS_WITHIN = 30.0
"""run() returns within this after stop(): the close bound (10 s) plus a loaded machine's
slack, and half the frozen member's session."""


@pytest.fixture
async def ledger(pg: Any) -> AsyncIterator[Ledger]:
    found = Ledger(pg)
    yield found
    await found.close()


async def test_stop_while_a_frozen_member_holds_the_join_returns_and_commits_nothing(
    kafka: KafkaService,
    topics: Topics,
    ledger: Ledger,
    members: Any,
    join_sent: asyncio.Event,
    caplog: pytest.LogCaptureFixture,
) -> None:
    topic = await topics.create("joining", partitions=2)
    group = "group-" + topic
    await topics.produce(topic, body(1), event_id="m-1")
    frozen = members(kafka, topic, group)
    assigned(frozen)
    freeze(frozen)

    joining = runner(kafka, ledger.handle, topic, group_id=group)
    sent = join_sent
    running = asyncio.create_task(joining.run())
    # Its JoinGroup is at the broker, held until the frozen member's session ends; a
    # retried one (a member id asked for first) is sent whatever stop() says meanwhile.
    await asyncio.wait_for(_first(sent, running), 60)
    # The loop turns while the join is held: the runner is alive, not ready. Before, it
    # sat in consumer.start() for the whole frozen session, and this timed out.
    first = joining.last_tick
    await asyncio.wait_for(_ticked(joining, first, running), 20)
    assert not joining.ready
    caplog.set_level(logging.WARNING, logger="consumerdedup.kafka")
    joining.stop()
    # Before: start() waited for the assignment, so run() lasted the frozen session.
    await asyncio.wait_for(running, RETURNS_WITHIN)
    assert not joining.ready
    assert ledger.applied() == [] and ledger.recorded() == set()
    assert await topics.lag(group, topic) == 1  # nothing committed: the record is kept
    said = [r.getMessage() for r in caplog.records if r.name == "consumerdedup.kafka"]
    assert any("did not close within" in line for line in said), said


async def _first(sent: asyncio.Event, running: asyncio.Task[None]) -> None:
    await asyncio.wait({asyncio.ensure_future(sent.wait()), running}, return_when="FIRST_COMPLETED")
    assert not running.done(), running
    assert sent.is_set()


async def _ticked(joining: Any, first: float, running: asyncio.Task[None]) -> None:
    while joining.last_tick == first:
        assert not running.done(), running
        await asyncio.sleep(0.01)  # polling a condition
