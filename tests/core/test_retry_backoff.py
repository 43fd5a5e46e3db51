"""RetryPolicy's in-process backoff, measured between a handler's calls.

The README: a transient error is "retried in process with exponential backoff and
jitter", each wait ``initial_delay * 2**(n-1)`` capped at ``max_delay``, plus a random
share of ``initial_delay``. The handler stamps the time of each call and asks to be
retried; the gaps between calls are the waits. Backoff's random source is replaced by
a fixed one so that the bounds are exact: no jitter for the growth and the cap, the
largest jitter to see that it is added at all. Sleeps are never shorter than asked, so
the lower bounds are strict; the upper bounds leave SLACK for a busy machine.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

import consumerdedup.retry
from consumerdedup import (
    AsyncDeduplicator,
    Deduplicator,
    Message,
    Outcome,
    Result,
    RetryLater,
    RetryPolicy,
)
from tests.conftest import Database

SLACK = 1.0
"""Seconds a wait may overrun on a loaded machine."""


class FixedRandom:
    """Stands in for the ``random`` module Backoff draws its jitter from."""

    def __init__(self, value: float) -> None:
        self.value = value
        self.draws = 0

    def random(self) -> float:
        self.draws += 1
        return self.value


def jitter(monkeypatch: pytest.MonkeyPatch, value: float) -> FixedRandom:
    fixed = FixedRandom(value)
    monkeypatch.setattr(consumerdedup.retry, "random", fixed)
    return fixed


def retried(db: Database, kind: str, policy: RetryPolicy) -> tuple[Result, list[float]]:
    """One message whose handler always asks to be retried; the times of its calls."""
    stamps: list[float] = []
    message = Message(id="m", body=b"{}")

    def call() -> None:
        stamps.append(time.monotonic())
        raise RetryLater("not yet")

    if kind == "sync":
        dedup = Deduplicator(db.engine, "c", tables=db.tables, retry=policy)
        handle = dedup.handler(lambda message, session: call())
        return handle.process(message), stamps

    async def run() -> Result:
        engine = db.async_engine()
        try:
            adedup = AsyncDeduplicator(engine, "c", tables=db.tables, retry=policy)

            @adedup.handler
            async def handle(message: Message, session: Any) -> None:
                call()

            return await handle.process(message)
        finally:
            await engine.dispose()

    return asyncio.run(run()), stamps


def gaps(stamps: list[float]) -> list[float]:
    return [later - earlier for earlier, later in itertools.pairwise(stamps)]


def check(result: Result, stamps: list[float], attempts: int) -> list[float]:
    assert result.outcome is Outcome.RETRY and result.attempts == attempts
    assert len(stamps) == attempts
    return gaps(stamps)


kinds = pytest.mark.parametrize("kind", ["sync", "async"])


@kinds
def test_the_wait_doubles_from_initial_delay_and_stops_at_max_delay(
    sqlite_db: Database, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    jitter(monkeypatch, 0.0)
    policy = RetryPolicy(
        attempts=8, initial_delay=timedelta(milliseconds=50), max_delay=timedelta(seconds=1.6)
    )
    result, stamps = retried(sqlite_db, kind, policy)
    waits = check(result, stamps, 8)
    expected = [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 1.6]  # uncapped, the last would be 3.2
    for n, (wait, least) in enumerate(zip(waits, expected, strict=True), start=1):
        assert least <= wait < least + SLACK, f"wait {n}: {wait:.3f}s, expected {least}s; {waits}"
    assert waits[5] > 2 * waits[0] and waits[5] > waits[2]  # it grew


@kinds
def test_a_random_share_of_initial_delay_is_added_to_every_wait(
    sqlite_db: Database, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    most = jitter(monkeypatch, 1.0)  # the largest jitter Backoff can draw
    policy = RetryPolicy(
        attempts=4, initial_delay=timedelta(milliseconds=300), max_delay=timedelta(seconds=0.3)
    )
    result, stamps = retried(sqlite_db, kind, policy)
    waits = check(result, stamps, 4)
    for n, wait in enumerate(waits, start=1):  # 0.3 s capped, plus 0.3 s of jitter
        assert 0.6 <= wait < 0.6 + SLACK, f"wait {n}: {wait:.3f}s; {waits}"
    assert most.draws == 3  # one draw per wait


@kinds
def test_jitter_varies_between_waits(
    sqlite_db: Database, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the real random source: each wait draws its own share."""
    drawn: list[float] = []
    real: Callable[[], float] = consumerdedup.retry.random.random

    class Recording:
        def random(self) -> float:
            drawn.append(real())
            return drawn[-1]

    monkeypatch.setattr(consumerdedup.retry, "random", Recording())
    policy = RetryPolicy(
        attempts=5, initial_delay=timedelta(milliseconds=20), max_delay=timedelta(milliseconds=20)
    )
    result, stamps = retried(sqlite_db, kind, policy)
    waits = check(result, stamps, 5)
    assert len(drawn) == 4 and len(set(drawn)) == 4
    for wait, share in zip(waits, drawn, strict=True):
        assert 0.02 + 0.02 * share <= wait + 1e-3, (waits, drawn)
