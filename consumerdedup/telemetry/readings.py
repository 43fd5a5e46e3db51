"""What the tables say, for ``consumerdedup stats``, its Prometheus text and ``/metrics``:
per consumer its records, the outbox's backlog, the rows in the DEFAULT partition.

One set of queries for every reader, so the numbers an operator alerts on are
the numbers ``stats`` prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, Table, case, func, select

from ..db.partitions import DayPartitions
from ..prune.idempotency import IN_FLIGHT
from ..schema import Tables


def utc(value: datetime) -> datetime:
    """SQLite gives back naive datetimes; the library always writes UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def iso(value: datetime | None) -> str | None:
    return utc(value).isoformat() if value is not None else None


def count_of(condition: Any) -> Any:
    """The rows for which ``condition`` holds, as one column of an aggregate select."""
    return func.coalesce(func.sum(case((condition, 1), else_=0)), 0)


def consumer_stats(engine: Engine, pe: Table) -> list[dict[str, Any]]:
    """Per consumer: its processed and failed records, all its rows, the oldest and newest."""
    at = pe.c.processed_at
    query = (
        select(pe.c.consumer, count_of(pe.c.outcome == "processed"))
        .add_columns(count_of(pe.c.outcome == "failed"), func.count(), func.min(at), func.max(at))
        .group_by(pe.c.consumer)
        .order_by(pe.c.consumer)
    )
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    keys = ("consumer", "processed", "failed", "rows", "oldest", "newest")
    return [
        dict(zip(keys, (c, int(p), int(f), int(n), iso(lo), iso(hi)), strict=True))
        for c, p, f, n, lo, hi in rows
    ]


def outbox_stats(engine: Engine, ob: Table) -> dict[str, Any]:
    """Unpublished counts what still waits to go out (parked rows too, not abandoned ones)."""
    not_out, abandoned = ob.c.published_at.is_(None), ob.c.abandoned_at.is_not(None)
    pending = not_out & ~abandoned
    query = select(
        count_of(pending),
        count_of(~not_out),
        count_of(pending & (ob.c.attempts > 0)),
        func.min(case((pending, ob.c.created_at))),
        count_of(pending & ob.c.parked_at.is_not(None)),
        count_of(not_out & abandoned),
    )
    with engine.connect() as conn:
        unpublished, published, failing, oldest, parked, gone = conn.execute(query).one()
    age = (datetime.now(UTC) - utc(oldest)).total_seconds() if oldest is not None else None
    return {
        "unpublished": int(unpublished),
        "published": int(published),
        "failing": int(failing),
        "parked": int(parked),
        "abandoned": int(gone),
        "oldest_unpublished_age_seconds": None if age is None else round(age, 3),
    }


def partition_stats(engine: Engine, tables: Tables) -> dict[str, Any] | None:
    """A partitioned processed_events' days and its DEFAULT partition's rows (PostgreSQL);
    None where it is not partitioned."""
    if engine.dialect.name != "postgresql":
        return None
    with engine.connect() as conn:
        return DayPartitions(tables.processed_events).summary(conn)


KEY_CONDITIONS = ("live", "expired", "in_flight", "abandoned", "not_stored")
"""What an idempotency key can be now; "not_stored" is a kind of live or expired record."""


def key_conditions(ik: Table, now: datetime) -> dict[str, Any]:
    """Each of KEY_CONDITIONS as a SQL condition on the idempotency_keys table at ``now``
    (the same rules as the store and the pruner): a completed record is live until it
    expires; an in-flight claim is in flight while its lease holds, abandoned after."""
    flying = ik.c.state == IN_FLIGHT
    lease_over = ik.c.locked_until <= now
    return {
        "live": ~flying & (ik.c.expires_at > now),
        "expired": ~flying & (ik.c.expires_at <= now),
        "in_flight": flying & ~lease_over,
        "abandoned": flying & lease_over,
        "not_stored": ik.c.state == "not_stored",
    }


def key_stats(engine: Engine, ik: Table) -> dict[str, int]:
    """Idempotency keys by what they are now (key_conditions)."""
    conditions = key_conditions(ik, datetime.now(UTC))
    query = select(*(count_of(conditions[name]) for name in KEY_CONDITIONS))
    with engine.connect() as conn:
        counts = conn.execute(query).one()
    return {name: int(n) for name, n in zip(KEY_CONDITIONS, counts, strict=True)}


@dataclass(frozen=True)
class Readings:
    """One reading of everything an operator alerts on."""

    consumers: list[dict[str, Any]]
    outbox: dict[str, Any]
    partitions: dict[str, Any] | None

    @classmethod
    def take(cls, engine: Engine, tables: Tables) -> Readings:
        return cls(
            consumer_stats(engine, tables.processed_events),
            outbox_stats(engine, tables.outbox),
            partition_stats(engine, tables),
        )
