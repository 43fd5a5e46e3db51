"""``consumerdedup stats``: per consumer, what was processed and failed; the outbox's backlog;
the HTTP idempotency keys: live, in flight, and expired (what the next prune deletes)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, Table, select

from ..prune.idempotency import IN_FLIGHT
from ..telemetry.readings import Readings
from ..telemetry.readings import count_of as _count
from .common import open_database, require_tables
from .outbox import require_columns
from .redact import shown

KEY_COLUMNS = ("live", "expired", "in_flight", "abandoned", "not_stored")
NAME = "stats"
HELP = "counts per consumer, of the outbox and of the HTTP idempotency keys"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--format",
        choices=("table", "json", "prometheus"),
        default="table",
        help="table (default), json (as --json), or prometheus: the gauges in the Prometheus "
        "text format, for a node-exporter textfile collector (consumerdedup[prometheus])",
    )


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
    readings = Readings.take(engine, tables)
    if args.format == "prometheus":
        from ..telemetry.prometheus import exposition

        sys.stdout.write(exposition(readings, tables))
        return 0
    consumers, outbox, days = readings.consumers, readings.outbox, readings.partitions
    ik = tables.idempotency_keys
    keys = key_stats(engine, ik)
    if args.json or args.format == "json":
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
    keys_shown = ("consumer", "processed", "failed", "oldest", "newest")
    rows = [[c[k] for k in keys_shown] for c in consumers]
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
