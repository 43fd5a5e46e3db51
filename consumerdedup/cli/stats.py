"""``consumerdedup stats``: per consumer, what was processed and failed; the outbox's backlog;
the HTTP idempotency keys: live, in flight, and expired (what the next prune deletes); the
Kafka offsets kept in the database, per group and topic."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine, Table, func, inspect, select

from ..telemetry.readings import Readings, key_stats
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


def offset_stats(engine: Engine, table: Table | None) -> list[dict[str, Any]]:
    """Per (group, topic) in consumer_offsets: partitions, the sum of their next offsets,
    the highest owner epoch (how often they were assigned) and the last write; none when
    the table is missing (made by an older release: init-db adds it)."""
    if table is None or not inspect(engine).has_table(table.name, schema=table.schema):
        return []
    c = table.c
    query = (
        select(
            c.consumer_group,
            c.topic,
            func.count(),
            func.sum(c.next_offset),
            func.max(c.owner_epoch),
            func.max(c.updated_at),
        )
        .group_by(c.consumer_group, c.topic)
        .order_by(c.consumer_group, c.topic)
    )
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    names = ("group", "topic", "partitions", "next_offsets_sum", "max_owner_epoch", "updated")
    return [{k: _plain(v) for k, v in zip(names, row, strict=True)} for row in rows]


def _plain(value: object) -> object:
    """A JSON value: a time as ISO 8601, a SUM's Decimal as an int."""
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return value if value is None or isinstance(value, str) else int(value)  # type: ignore[call-overload]


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
    co = tables.consumer_offsets
    offsets = offset_stats(engine, co)
    if args.json or args.format == "json":
        processed: dict[str, Any] = {"table": pe.fullname, "consumers": consumers}
        if days is not None:
            processed["partitioned"] = days
        report = {
            "processed_events": processed,
            "outbox": {"table": ob.fullname, **outbox},
            "idempotency_keys": {"table": ik.fullname, **keys},
        }
        if co is not None:
            report["consumer_offsets"] = {"table": co.fullname, "groups": offsets}
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
    if co is not None:
        print(f"\nKafka offsets in the database ({co.fullname}):")
        headers = ["group", "topic", "partitions", "sum of next offsets", "max owner epoch"]
        headers.append("last written")
        columns = ("group", "topic", "partitions", "next_offsets_sum", "max_owner_epoch")
        rows = [[o[k] for k in (*columns, "updated")] for o in offsets]
        print(_table(headers, rows) if rows else "(none)")
    return 0
