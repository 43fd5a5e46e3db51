"""Pruning speed: batch deletes (what Pruner does) against dropping daily partitions.

Run it: ``.venv/bin/python bench/bench_pruner.py`` (``--quick`` for a smoke run). It needs
a PostgreSQL server (``CONSUMERDEDUP_BENCH_PG_URL``, default the local ``test`` database);
everything lives in a fresh schema, dropped at the end.

1. PostgreSQL batch deletes: ``--rows`` expired rows spread over 10 whole days, pruned by
   ``Pruner`` at each ``--batch-sizes``; rows pruned per second.
2. A consumer (Deduplicator, 10 messages a transaction, one business insert each) alone,
   then while the pruner deletes ``--rows`` rows, without and with a 20 ms pause between
   batches: the consumer's throughput and batch latency, and the pruner's rate.
3. Partition drops: the same rows in a processed_events partitioned by day
   (``Tables.define(partitioned=True)``), pruned by ``Pruner`` (whole days dropped); then
   the consumer of 2. on that table alone and while the pruner drops the days.
4. SQLite batch deletes, for scale (``--sqlite-rows``, a file in a temporary folder).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import sqlalchemy
from sqlalchemy import Engine, create_engine, text

from consumerdedup import Deduplicator, Message, Pruner, Tables, durations, install
from consumerdedup.db.partitions import DayPartitions

sys.path.insert(0, os.path.dirname(__file__))
from bench_pipeline import cpu_model

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
DAYS = 10


def conditions(engine: Engine, args: argparse.Namespace) -> None:
    with engine.connect() as conn:
        server = conn.execute(text("SHOW server_version")).scalar()
        settings = {
            name: conn.execute(text(f"SHOW {name}")).scalar()
            for name in ("shared_buffers", "synchronous_commit", "max_wal_size")
        }
    import sqlite3

    print("conditions")
    print(f"  cpu: {cpu_model()} x {os.cpu_count()}; load {os.getloadavg()[0]:.2f}")
    print(
        f"  python {platform.python_version()}, sqlalchemy {sqlalchemy.__version__}, "
        f"psycopg {psycopg.__version__}, sqlite {sqlite3.sqlite_version}"
    )
    print(f"  postgresql {server}: {', '.join(f'{k}={v}' for k, v in settings.items())}")
    print(
        f"  rows: {args.rows:,} expired (over {DAYS} days, ~{row_bytes(engine):.0f} B each "
        f"as stored), batch sizes {args.batch_sizes}, sqlite rows {args.sqlite_rows:,}"
    )
    print()


def row_bytes(engine: Engine) -> float:
    with engine.connect() as conn:
        return float(
            conn.execute(
                text(
                    "SELECT avg(pg_column_size(r)) FROM (SELECT 'ledger'::varchar AS consumer, "
                    "'old-123456' AS message_id, now() AS processed_at, "
                    "repeat('a', 64) AS payload_hash, "
                    "'processed' AS outcome, NULL::text AS error) r"
                )
            ).scalar()
            or 0
        )


def fixed(moment: datetime) -> Callable[[], datetime]:
    """The pruner's clock, pinned to when the rows were written."""
    return lambda: moment


def day_zero(t0: datetime) -> datetime:
    """Midnight before the cutoff (t0 - 8 days): every expired row lies in whole days before it."""
    cutoff = t0 - timedelta(days=8)
    return cutoff.replace(hour=0, minute=0, second=0, microsecond=0)


def fill(
    engine: Engine, table: str, rows: int, t0: datetime, prefix: str = "old", analyze: bool = True
) -> float:
    """``rows`` rows over DAYS whole days before day_zero; returns the seconds it took."""
    started = time.perf_counter()
    per_day_ms = 86_400_000 // (rows // DAYS + 1)  # offsets stay inside their day
    with engine.begin() as conn:
        conn.execute(
            text(
                f"INSERT INTO {table} (consumer, message_id, processed_at, payload_hash, outcome) "
                f"SELECT 'ledger', '{prefix}-' || i, "
                f"CAST(:d0 AS timestamptz) - (1 + i % {DAYS}) * interval '1 day' "
                f"+ (i / {DAYS}) * {per_day_ms} * interval '1 ms', repeat('a', 64), 'processed' "
                "FROM generate_series(1, :n) AS i"
            ),
            {"d0": day_zero(t0), "n": rows},
        )
        if analyze:
            conn.execute(text(f"ANALYZE {table}"))
    return time.perf_counter() - started


# --------------------------------------------------------------------------- 1. batch deletes


def bench_batches(engine: Engine, tables: Tables, args: argparse.Namespace) -> float:
    table = tables.processed_events.fullname
    print("1. PostgreSQL batch deletes (Pruner)")
    best = 0.0
    for size in args.batch_sizes:
        t0 = datetime.now(UTC)
        inserted = fill(engine, table, args.rows, t0)
        pruner = Pruner(engine, timedelta(days=7), tables=tables, batch_size=size, clock=fixed(t0))
        started = time.perf_counter()
        deleted = pruner.prune()
        seconds = time.perf_counter() - started
        assert deleted == args.rows, deleted
        best = max(best, deleted / seconds)
        print(
            f"  batch {size:>6,}: {deleted:,} rows in {seconds:6.2f}s = "
            f"{deleted / seconds:>9,.0f} rows/s  (insert took {inserted:.1f}s)"
        )
        vacuum(engine, table)
    print()
    return best


def vacuum(engine: Engine, table: str) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f"VACUUM {table}"))


# --------------------------------------------------------------------------- 2. a live consumer


class Consumer:
    def __init__(self, engine: Engine, tables: Tables, ledger: str) -> None:
        dedup = Deduplicator(engine, consumer="ledger", tables=tables)

        @dedup.handler
        def credit(message: Message, session: Any) -> None:
            session.execute(text(f"INSERT INTO {ledger} VALUES (:id, 1)"), {"id": message.id})

        self.handler = credit
        self.batches: list[tuple[float, float]] = []  # (end, seconds)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.count = 0

    def run(self) -> None:
        while not self.stop.is_set():
            messages = [Message(id=f"live-{uuid.uuid4().hex}", body=b"{}") for _ in range(10)]
            started = time.perf_counter()
            self.handler.process_batch(messages)
            ended = time.perf_counter()
            self.batches.append((ended, ended - started))

    def window(self, start: float, end: float) -> tuple[float, float, float]:
        """messages/s, median and max batch latency (ms) between start and end."""
        inside = [seconds for at, seconds in self.batches if start <= at <= end]
        if not inside:
            return 0.0, 0.0, 0.0
        rate = len(inside) * 10 / (end - start)
        return rate, statistics.median(inside) * 1000, max(inside) * 1000


def bench_consumer(engine: Engine, tables: Tables, args: argparse.Namespace) -> None:
    table = tables.processed_events.fullname
    ledger = f"{tables.processed_events.schema}.ledger"
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {ledger} (message_id TEXT, amount INTEGER)"))
    print(f"2. a consumer (10 messages a transaction) while {args.rows:,} rows are pruned")
    consumer = Consumer(engine, tables, ledger)
    consumer.thread.start()
    time.sleep(1.0)  # warm-up
    start = time.perf_counter()
    time.sleep(args.baseline)
    alone = consumer.window(start, time.perf_counter())
    print(
        f"  consumer alone:          {alone[0]:7,.0f} msg/s, batch latency median "
        f"{alone[1]:5.1f} ms, max {alone[2]:6.1f} ms"
    )
    for pause in (timedelta(0), timedelta(milliseconds=20)):
        t0 = datetime.now(UTC)
        fill(engine, table, args.rows, t0)
        pruner = Pruner(
            engine, timedelta(days=7), tables=tables, clock=fixed(t0), batch_pause=pause
        )
        start = time.perf_counter()
        deleted = pruner.prune()
        end = time.perf_counter()
        rate, median, worst = consumer.window(start, end)
        label = f"batch_pause={durations.render(pause)}"
        print(
            f"  pruning, {label:<15}: {rate:7,.0f} msg/s, batch latency median {median:5.1f} ms, "
            f"max {worst:6.1f} ms ({rate / alone[0]:.0%} of alone); pruner "
            f"{deleted / (end - start):,.0f} rows/s"
        )
        vacuum(engine, table)
    consumer.stop.set()
    consumer.thread.join()
    print()


# --------------------------------------------------------------------------- 3. partitions


def bench_partitions(engine: Engine, plain: Tables, schema: str, args: argparse.Namespace) -> float:
    """The same rows in processed_events partitioned by day (Tables.define(partitioned=True))."""
    print("3. a partitioned processed_events (Tables.define(partitioned=True)), pruned by Pruner")
    tables = Tables.define(f"{schema}.pe_by_day", f"{schema}.ob_by_day", partitioned=True)
    install(engine, tables)
    days = DayPartitions(tables.processed_events)
    ledger = f"{schema}.ledger_by_day"
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {ledger} (message_id TEXT, amount INTEGER)"))
    best = 0.0
    for size in args.batch_sizes[:1]:
        t0 = datetime.now(UTC)
        make_days(engine, days, t0)
        fill_days(engine, tables, days, args.rows, t0)
        pruner = Pruner(engine, timedelta(days=7), tables=tables, batch_size=size, clock=fixed(t0))
        started = time.perf_counter()
        report = pruner.run_once()
        seconds = time.perf_counter() - started
        assert report.total == args.rows, report
        best = max(best, report.total / seconds)
        print(
            f"  drops: {report.total:,} rows in {seconds:6.2f}s = {report.total / seconds:>12,.0f} "
            f"rows/s ({len(report.partitions)} partitions, rows counted before each drop)"
        )
    vacuum(engine, plain.processed_events.fullname)  # section 2's dead rows: quiet autovacuum
    for label, on in (("unpartitioned", plain), ("partitioned", tables)):
        consumer = Consumer(engine, on, ledger)
        consumer.thread.start()
        time.sleep(1.0)
        start = time.perf_counter()
        time.sleep(args.baseline)
        alone = consumer.window(start, time.perf_counter())
        print(
            f"  consumer alone, {label + ':':<15} {alone[0]:7,.0f} msg/s, batch latency median "
            f"{alone[1]:5.1f} ms, max {alone[2]:6.1f} ms"
        )
        if on is plain:
            consumer.stop.set()
            consumer.thread.join()
    t0 = datetime.now(UTC)
    make_days(engine, days, t0)
    fill_days(engine, tables, days, args.rows, t0)
    pruner = Pruner(engine, timedelta(days=7), tables=tables, clock=fixed(t0))
    start = time.perf_counter()
    report = pruner.run_once()
    end = time.perf_counter()
    time.sleep(0.2)  # a batch that waited on a drop ends after it: count it in
    rate, median, worst = consumer.window(start, end + 0.2)
    print(
        f"  pruning by drops:              {rate:7,.0f} msg/s, batch latency median "
        f"{median:5.1f} ms, max {worst:6.1f} ms ({rate / alone[0]:.0%} of alone); pruner "
        f"{report.total / (end - start):,.0f} rows/s"
    )
    consumer.stop.set()
    consumer.thread.join()
    print()
    return best


def make_days(engine: Engine, days: DayPartitions, t0: datetime) -> None:
    """The day partitions fill() writes into: DAYS whole days before day_zero."""
    with engine.begin() as conn:
        days.ensure(conn, (day_zero(t0) - timedelta(days=DAYS)).date(), DAYS)


def fill_days(engine: Engine, tables: Tables, days: DayPartitions, rows: int, t0: datetime) -> None:
    """fill(), analyzing only the filled days, as autovacuum would.

    An ANALYZE of the whole partitioned table would also record today's empty
    partition as empty: the consumers' cached generic plans then scan it
    sequentially until autovacuum analyzes it again (README: Partitioned).
    """
    fill(engine, tables.processed_events.fullname, rows, t0, analyze=False)
    first = (day_zero(t0) - timedelta(days=DAYS)).date()
    with engine.begin() as conn:
        for k in range(DAYS):
            conn.execute(
                text(f"ANALYZE {days.qualified(days.name_for(first + timedelta(days=k)))}")
            )


# --------------------------------------------------------------------------- 4. SQLite


def bench_sqlite(args: argparse.Namespace) -> None:
    folder = tempfile.mkdtemp(prefix="consumerdedup-bench-")
    engine = create_engine(f"sqlite:///{folder}/bench.db")
    with engine.connect() as conn:
        conn.exec_driver_sql("PRAGMA journal_mode=WAL")
    tables = Tables.define()
    install(engine, tables)
    t0 = datetime.now(UTC)
    d0 = day_zero(t0)
    rows = [
        {
            "consumer": "ledger",
            "message_id": f"old-{i}",
            "processed_at": d0 - timedelta(days=1 + i % DAYS, milliseconds=i),
            "payload_hash": "a" * 64,
            "outcome": "processed",
        }
        for i in range(args.sqlite_rows)
    ]
    with engine.begin() as conn:
        conn.execute(tables.processed_events.insert(), rows)
    pruner = Pruner(engine, timedelta(days=7), tables=tables, clock=fixed(t0))
    started = time.perf_counter()
    deleted = pruner.prune()
    seconds = time.perf_counter() - started
    print("4. SQLite batch deletes (WAL, a file on local disk)")
    print(
        f"  batch  5,000: {deleted:,} rows in {seconds:6.2f}s = {deleted / seconds:>9,.0f} rows/s"
    )
    engine.dispose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch-sizes", default="1000,5000,20000")
    parser.add_argument("--sqlite-rows", type=int, default=200_000)
    parser.add_argument("--baseline", type=float, default=5.0, help="seconds of consumer alone")
    parser.add_argument("--quick", action="store_true", help="100k rows, one batch size")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.batch_sizes, args.sqlite_rows, args.baseline = 100_000, "5000", 20_000, 2.0
    args.batch_sizes = [int(s) for s in args.batch_sizes.split(",")]
    url = os.environ.get("CONSUMERDEDUP_BENCH_PG_URL", DEFAULT_URL)
    engine = create_engine(url, pool_size=4)
    schema = f"bench_prune_{uuid.uuid4().hex[:8]}"
    tables = Tables.define(f"{schema}.processed_events", f"{schema}.outbox")
    install(engine, tables)
    try:
        conditions(engine, args)
        batch_rate = bench_batches(engine, tables, args)
        bench_consumer(engine, tables, args)
        drop_rate = bench_partitions(engine, tables, schema, args)
        bench_sqlite(args)
        print(
            f"\npartition drops prune {drop_rate / batch_rate:,.0f}x faster than the best "
            "batch delete; the consumer's cost is in 3."
        )
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
        engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
