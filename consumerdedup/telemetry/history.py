"""The last hours from the database, for the admin overview's charts: FAILED records by
the hour they failed, and the outbox backlog at each hour's end.

Both are read from the tables, not sampled by a process, so they are there on the first
load and the same for every reader. What they can say is bounded by what the tables
still hold: a FAILED record forgotten or replayed is no longer counted in its hour; the
backlog is exact back to the pruner's outbox cutoff (a published row pruned no longer
says when it was waiting). Each series is one statement, one column per point.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, select

from ..options import integer
from ..outcome import Outcome
from ..schema import Tables
from .readings import count_of

MOST_HOURS = 168


def history(
    engine: Engine, tables: Tables, *, hours: int = 24, now: datetime | None = None
) -> dict[str, Any]:
    """``failed``: per hour of the last ``hours``, the FAILED records that failed in it;
    ``backlog``: unpublished, unabandoned events at each hour's end; ``hours``: each
    hour's end (UTC, ISO 8601), oldest first."""
    integer(hours, "hours", at_least=1, at_most=MOST_HOURS)
    now = (now or datetime.now(UTC)).astimezone(UTC)
    ends = [now - timedelta(hours=hours - 1 - i) for i in range(hours)]
    pe, ob = tables.processed_events, tables.outbox
    at = pe.c.processed_at
    failed = select(
        *(count_of((at > end - timedelta(hours=1)) & (at <= end)) for end in ends)
    ).where(pe.c.outcome == Outcome.FAILED.value, at > ends[0] - timedelta(hours=1))

    def waiting(end: datetime) -> Any:
        out = ob.c.published_at.is_(None) | (ob.c.published_at > end)
        kept = ob.c.abandoned_at.is_(None) | (ob.c.abandoned_at > end)
        return (ob.c.created_at <= end) & out & kept

    backlog = select(*(count_of(waiting(end)) for end in ends))
    with engine.connect() as conn:
        failed_counts = conn.execute(failed).one()
        backlog_counts = conn.execute(backlog).one()
    return {
        "hours": [end.isoformat() for end in ends],
        "failed": [int(n) for n in failed_counts],
        "backlog": [int(n) for n in backlog_counts],
    }
