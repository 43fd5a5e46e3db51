"""Each message waits by its OWN failures: the documented 50/100/200 ms schedule, in a batch.

Issue 38 item 6: the pipeline took each wait from the batch's round count, so
only a batch's first message followed ``initial_delay`` doubling; every later
one waited about ``max_delay`` between its attempts (a batch of 100 failing
messages took minutes). Measured with a clock: the drivers' sleeps are
recorded and advance a fake time that the handler stamps, so nothing here
depends on how fast the machine is. Jitter is fixed at 0 (Backoff's random
source replaced), so each wait is exact.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest

import consumerdedup.retry
from consumerdedup import AsyncDeduplicator, Deduplicator, Message, Outcome, Result, RetryPolicy
from consumerdedup.dedup import async_deduplicator, deduplicator
from tests.conftest import Database

SCHEDULE = [0.05, 0.1, 0.2]
"""The documented waits of the default policy (4 attempts, 50 ms doubling, 2 s at most)."""


class Clock:
    """Fake time that moves only when a driver sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    async def sleep_async(self, seconds: float) -> None:
        self.sleep(seconds)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(consumerdedup.retry, "random", SimpleNamespace(random=lambda: 0.0))
    monkeypatch.setattr(deduplicator, "time", SimpleNamespace(sleep=fake.sleep))
    monkeypatch.setattr(async_deduplicator, "asyncio", SimpleNamespace(sleep=fake.sleep_async))
    return fake


def run_batch(
    db: Database, kind: str, messages: list[Message], fails: set[str], claim_first: bool,
    clock: Clock,
) -> tuple[list[Result], dict[str, list[float]]]:  # fmt: skip
    """``messages`` through one ``process_batch``; those in ``fails`` raise KeyError every
    time (a deploy reading a renamed field). The fake time of each handler call, per id."""
    calls: dict[str, list[float]] = defaultdict(list)

    def call(message: Message) -> None:
        calls[message.id].append(clock.now)
        if message.id in fails:
            raise KeyError("customer_id")

    policy = RetryPolicy()  # the defaults the docs promise: 4 attempts, 50 ms .. 2 s
    if kind == "sync":
        dedup = Deduplicator(db.engine, "c", tables=db.tables, retry=policy)
        handle = dedup.handler(claim_first=claim_first)(lambda message, session: call(message))
        return handle.process_batch(messages), calls

    async def run() -> list[Result]:
        engine = db.async_engine()
        try:
            adedup = AsyncDeduplicator(engine, "c", tables=db.tables, retry=policy)

            @adedup.handler(claim_first=claim_first)
            async def handle(message: Message, session: Any) -> None:
                call(message)

            return await handle.process_batch(messages)
        finally:
            await engine.dispose()

    return asyncio.run(run()), calls


def gaps(stamps: list[float]) -> list[float]:
    return [round(later - earlier, 6) for earlier, later in itertools.pairwise(stamps)]


drivers = pytest.mark.parametrize("kind", ["sync", "async"])
modes = pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])


@drivers
@modes
def test_every_message_of_a_failing_batch_follows_the_documented_schedule(
    sqlite_db: Database, kind: str, claim_first: bool, clock: Clock
) -> None:
    messages = [Message(id=f"m{n}", body=b"{}") for n in range(6)]
    ids = {m.id for m in messages}
    results, calls = run_batch(sqlite_db, kind, messages, ids, claim_first, clock)
    assert [r.outcome for r in results] == [Outcome.FAILED] * 6
    for message in messages:
        assert gaps(calls[message.id]) == SCHEDULE, (message.id, dict(calls))
    # The driver's sleeps are exactly those waits: none of max_delay, none extra.
    assert sorted(clock.sleeps) == sorted(SCHEDULE * 6)
    assert clock.now == pytest.approx(6 * sum(SCHEDULE))


@drivers
@modes
def test_a_failing_message_late_in_a_batch_waits_its_own_schedule(
    sqlite_db: Database, kind: str, claim_first: bool, clock: Clock
) -> None:
    """Healthy messages before and between the failing ones: the failing ones' waits are
    still 50/100/200 ms, and a healthy message never waits (it runs once)."""
    messages = [Message(id=f"m{n}", body=b"{}") for n in range(8)]
    fails = {"m3", "m6"}
    results, calls = run_batch(sqlite_db, kind, messages, fails, claim_first, clock)
    outcomes = {r.message.id: r.outcome for r in results}
    assert {i for i, o in outcomes.items() if o is Outcome.FAILED} == fails
    for failing in fails:
        assert gaps(calls[failing]) == SCHEDULE, (failing, dict(calls))
    assert sorted(clock.sleeps) == sorted(SCHEDULE * 2)
    assert max(clock.sleeps) < RetryPolicy().max_delay.total_seconds()


@drivers
def test_the_waits_grow_to_max_delay_and_stay_there(
    sqlite_db: Database, kind: str, clock: Clock
) -> None:
    """The last message of a batch with more attempts: its own doubling up to the cap."""
    policy = RetryPolicy(
        attempts=7, initial_delay=timedelta(milliseconds=50), max_delay=timedelta(milliseconds=400)
    )
    messages = [Message(id=f"m{n}", body=b"{}") for n in range(3)]
    calls: dict[str, list[float]] = defaultdict(list)

    def call(message: Message) -> None:
        calls[message.id].append(clock.now)
        raise KeyError("customer_id")

    if kind == "sync":
        handle = Deduplicator(sqlite_db.engine, "c", tables=sqlite_db.tables, retry=policy).handler(
            lambda message, session: call(message)
        )
        results = handle.process_batch(messages)
    else:

        async def run() -> list[Result]:
            engine = sqlite_db.async_engine()
            try:
                adedup = AsyncDeduplicator(engine, "c", tables=sqlite_db.tables, retry=policy)

                @adedup.handler
                async def handle(message: Message, session: Any) -> None:
                    call(message)

                return await handle.process_batch(messages)
            finally:
                await engine.dispose()

        results = asyncio.run(run())
    assert all(r.outcome is Outcome.FAILED and r.attempts == 7 for r in results)
    for message in messages:
        assert gaps(calls[message.id]) == [0.05, 0.1, 0.2, 0.4, 0.4, 0.4], dict(calls)
