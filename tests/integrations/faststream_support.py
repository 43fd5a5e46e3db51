"""What the FastStream tests share: a ledger handler's deduplicator, outcomes seen by an
observer, and polling with a deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from consumerdedup import AsyncDeduplicator, Outcome, Result, RetryPolicy
from tests.conftest import Database

ONE_TRY = RetryPolicy(attempts=1, initial_delay=timedelta(0), max_delay=timedelta(0))
DEADLINE = 30.0


@dataclass
class Seen:
    """Every Result the deduplicator reported, in order."""

    results: list[Result] = field(default_factory=list)

    def outcomes(self) -> list[Outcome]:
        return [r.outcome for r in self.results]


def deduplicator(
    pg: Database, engine: AsyncEngine, seen: Seen, **options: Any
) -> AsyncDeduplicator:
    options.setdefault("retry", ONE_TRY)
    return AsyncDeduplicator(
        engine, "faststream", tables=pg.tables, observers=[seen.results.append], **options
    )


def rows(pg: Database, ledger: str) -> list[tuple[Any, ...]]:
    with pg.engine.connect() as conn:
        found = conn.execute(text(f"SELECT message_id, amount FROM {ledger} ORDER BY 1"))
        return [tuple(r) for r in found]


def records(pg: Database) -> list[tuple[str, str]]:
    with pg.engine.connect() as conn:
        found = conn.execute(
            text(f"SELECT message_id, outcome FROM {pg.name('processed_events')} ORDER BY 1")
        )
        return [(r[0], r[1]) for r in found]


async def until(condition: Callable[[], bool], what: str, deadline: float = DEADLINE) -> None:
    """Poll ``condition`` until it holds; AssertionError naming ``what`` past the deadline."""
    end = time.monotonic() + deadline
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"not within {deadline:.0f} s: {what}")
        await asyncio.sleep(0.05)


async def eventually(
    probe: Callable[[], Awaitable[object]], expected: object, what: str, deadline: float = DEADLINE
) -> None:
    """Await ``probe`` until it returns ``expected``; AssertionError past the deadline."""
    end = time.monotonic() + deadline
    while (found := await probe()) != expected:
        if time.monotonic() > end:
            raise AssertionError(f"not within {deadline:.0f} s: {what} (last: {found!r})")
        await asyncio.sleep(0.05)
