"""``consumerdedup stats``: per consumer, what was processed and failed; the outbox's backlog;
the HTTP idempotency keys: live, in flight, and expired (what the next prune deletes)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, Table, case, func, select

from ..db.partitions import DayPartitions
from ..prune.idempotency import IN_FLIGHT
from ..schema import Tables
from .common import open_database, require_tables
from .outbox import require_columns
from .redact import shown

KEY_COLUMNS = ("live", "expired", "in_flight", "abandoned", "not_stored")
NAME = "stats"
HELP = "counts per consumer, of the outbox and of the HTTP idempotency keys"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _utc(value: datetime) -> datetime:
    """SQLite gives back naive datetimes; the library always writes UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _iso(value: datetime | None) -> str | None:
    return _utc(value).isoformat() if value is not None else None


def _count(condition: Any) -> Any:
    return func.coalesce(func.sum(case((condition, 1), else_=0)), 0)


def consumer_stats(engine: Engine, pe: Table) -> list[dict[str, Any]]:
    at = pe.c.processed_at
    query = (
        select(pe.c.consumer, _count(pe.c.outcome == "processed"), _count(pe.c.outcome == "failed"))
        .add_columns(func.min(at), func.max(at))
        .group_by(pe.c.consumer)
        .order_by(pe.c.consumer)
    )
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    keys = ("consumer", "processed", "failed", "oldest", "newest")
    return [
        dict(zip(keys, (c, int(p), int(f), _iso(lo), _iso(hi)), strict=True))
        for c, p, f, lo, hi in rows
    ]


def outbox_stats(engine: Engine, ob: Table) -> dict[str, Any]:
    """Unpublished counts what still waits to go out (parked rows too, not abandoned ones)."""
    not_out, abandoned = ob.c.published_at.is_(None), ob.c.abandoned_at.is_not(None)
    pending = not_out & ~abandoned
    query = select(
        _count(pending),
        _count(~not_out),
        _count(pending & (ob.c.attempts > 0)),
        func.min(case((pending, ob.c.created_at))),
        _count(pending & ob.c.parked_at.is_not(None)),
        _count(not_out & abandoned),
    )
    with engine.connect() as conn:
        unpublished, published, failing, oldest, parked, gone = conn.execute(query).one()
    age = (datetime.now(UTC) - _utc(oldest)).total_seconds() if oldest is not None else None
    return {
        "unpublished": int(unpublished),
        "published": int(published),
        "failing": int(failing),
        "parked": int(parked),
        "abandoned": int(gone),
        "oldest_unpublished_age_seconds": None if age is None else round(age, 3),
    }


def key_stats(engine: Engine, ik: Table) -> dict[str, int]:
    """Idempotency keys by what they are now (the same rules as the store and the pruner)."""
    now = datetime.now(UTC)
    flying = ik.c.state == IN_FLIGHT
    lease_over = ik.c.locked_until <= now
    query = select(
        _count(~flying & (ik.c.expires_at > now)),
        _count(~flying & (ik.c.expires_at <= now)),
        _count(flying & ~lease_over),
        _count(flying & lease_over),
        _count(ik.c.state == "not_stored"),
    )
    with engine.connect() as conn:
        live, expired, in_flight, abandoned, not_stored = conn.execute(query).one()
    return {
        "live": int(live),
        "expired": int(expired),
        "in_flight": int(in_flight),
        "abandoned": int(abandoned),
        "not_stored": int(not_stored),
    }


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(headers), *[["-" if v is None else str(v) for v in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def run(args: argparse.Namespace) -> int:
    url, engine, tables = open_database(args)
    require_tables(engine, tables)
    pe, ob = tables.processed_events, tables.outbox
    require_columns(engine, ob)
    consumers, outbox = consumer_stats(engine, pe), outbox_stats(engine, ob)
    ik = tables.idempotency_keys
    keys = key_stats(engine, ik)
    days = _partition_stats(engine, tables)
    if args.json:
        processed: dict[str, Any] = {"table": pe.fullname, "consumers": consumers}
        if days is not None:
            processed["partitioned"] = days
        report = {
            "processed_events": processed,
            "outbox": {"table": ob.fullname, **outbox},
            "idempotency_keys": {"table": ik.fullname, **keys},
        }
        print(json.dumps({"database": shown(url), **report}, indent=2))
        return 0
    rows = [list(c.values()) for c in consumers]
    headers = ["consumer", "processed", "failed", "oldest processed_at", "newest processed_at"]
    print(f"database: {shown(url)}\n\nprocessed events ({pe.fullname}):")
    print(_table(headers, rows) if rows else "(no records)")
    if days is not None:
        span = f", {days['oldest_from']} to {days['newest_to']}" if days["partitions"] else ""
        print(
            f"partitioned by day: {days['partitions']} partitions{span}; "
            f"{days['rows_in_default']:,} rows in DEFAULT"
            + (
                " (days not made in time: keep the pruner scheduled)"
                if days["rows_in_default"]
                else ""
            )
        )
    age = outbox["oldest_unpublished_age_seconds"]
    counts = [outbox[k] for k in ("unpublished", "published", "failing", "parked", "abandoned")]
    print(f"\noutbox ({ob.fullname}):")
    headers = ["unpublished", "published", "failing (attempts > 0)", "parked", "abandoned"]
    headers.append("oldest unpublished age")
    print(_table(headers, [[*counts, None if age is None else _duration(age)]]))
    print(f"\nidempotency keys ({ik.fullname}):")
    headers = ["live", "expired (next prune)", "in flight", "abandoned (lease over)"]
    headers.append("of them not stored")
    print(_table(headers, [[keys[k] for k in KEY_COLUMNS]]))
    return 0


def _partition_stats(engine: Engine, tables: Tables) -> dict[str, Any] | None:
    if engine.dialect.name != "postgresql":
        return None
    with engine.connect() as conn:
        return DayPartitions(tables.processed_events).summary(conn)
