"""Pruning speed: batch deletes (what Pruner does) against dropping daily partitions.

Run it: ``.venv/bin/python bench/bench_pruner.py`` (``--quick`` for a smoke run). It needs
a PostgreSQL server (``CONSUMERDEDUP_BENCH_PG_URL``, default the local ``test`` database);
everything lives in a fresh schema, dropped at the end. Every figure is the median of
``--rounds`` rounds (default 3) with its spread (slowest-fastest round), every
configuration runs the same number of rounds, round-robin (the order reverses every
other round), and the conditions are printed first (``bench/measure.py``).

Every round writes ``--rows`` expired rows over 10 whole days and 1,000 younger rows (one
exactly at the cutoff) with one pinned clock; after every prune the bench checks that
every expired row is gone and every younger row is still there.

1. PostgreSQL batch deletes: ``Pruner`` at each ``--batch-sizes``, and next to it the
   best plain psycopg loop doing the same deletes (the same keyset walk of the
   processed_at index, ctid deletes, the same batch size, one autocommit statement a
   batch); rows pruned per second and the ratio Pruner / plain psycopg.
2. A consumer (Deduplicator, 10 messages a transaction, one business insert each) while
   the pruner deletes ``--rows`` rows, without and with a 20 ms pause between batches.
   In each round the consumer is measured alone just before the prune, over a window as
   long as the prune (at most ``--baseline`` seconds), then during it: its rate, its
   rate as % of alone in that round, its batch latency, and the pruner's rate.
3. Partition drops: the same rows in a processed_events partitioned by day
   (``Tables.define(partitioned=True)``), pruned by ``Pruner`` (whole days dropped):
   rows/s and seconds against the best batch delete of 1.; then the consumer of 2. on
   that table alone and while the pruner drops the days (worst batch latency, same-length
   windows).
4. SQLite batch deletes, for scale (``--sqlite-rows``, a file in a temporary folder).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from sqlalchemy import Engine, create_engine, text

from consumerdedup import Deduplicator, Message, Pruner, Tables, durations, install
from consumerdedup.db.partitions import DayPartitions
from consumerdedup.prune.statements import EARLIEST

sys.path.insert(0, os.path.dirname(__file__))
from measure import Conditions, Series, add_round_arguments, check_rounds, print_table

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
DAYS = 10
YOUNG = 1000  # rows at and just after the cutoff, written with every fill: they must stay
RETENTION = timedelta(days=7)  # + the default buffer (1 day): the cutoff is T0 - 8 days
BODY = b"{}"
PAUSES = (timedelta(0), timedelta(milliseconds=20))
SQLITE_SYNCHRONOUS = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}

# One pinned clock for the whole run: every round has the same cutoff, and a younger row
# written by one round is still younger in the next.
T0 = datetime.now(UTC)
CUTOFF = T0 - timedelta(days=8)
DAY_ZERO = CUTOFF.replace(hour=0, minute=0, second=0, microsecond=0)
"""Midnight before the cutoff: every expired row lies in the DAYS whole days before it."""


def clock() -> datetime:
    return T0


def pruner(engine: Engine, tables: Tables, **options: Any) -> Pruner:
    return Pruner(engine, RETENTION, tables=tables, clock=clock, **options)


# --------------------------------------------------------------------------- rows


def fill(
    engine: Engine, table: str, rows: int, tag: str, analyze: Sequence[str] | None = None
) -> None:
    """``rows`` expired rows over DAYS whole days before DAY_ZERO, and YOUNG rows from the
    cutoff on; then VACUUM ANALYZE (``analyze``: these tables instead of ``table``).

    The VACUUM leaves the rows as old rows are in production: hinted, all-visible, and no
    autovacuum of the insert waiting to start in the middle of a measurement.
    """
    per_day_ms = 86_400_000 // (rows // DAYS + 1)  # offsets stay inside their day
    with engine.begin() as conn:
        conn.execute(
            text(
                f"INSERT INTO {table} (consumer, message_id, processed_at, payload_hash, outcome) "
                f"SELECT 'ledger', 'old-{tag}-' || i, "
                f"CAST(:d0 AS timestamptz) - (1 + i % {DAYS}) * interval '1 day' "
                f"+ (i / {DAYS}) * {per_day_ms} * interval '1 ms', repeat('a', 64), 'processed' "
                "FROM generate_series(1, :n) AS i"
            ),
            {"d0": DAY_ZERO, "n": rows},
        )
        conn.execute(
            text(
                f"INSERT INTO {table} (consumer, message_id, processed_at, payload_hash, outcome) "
                f"SELECT 'ledger', 'young-{tag}-' || i, "
                "CAST(:cutoff AS timestamptz) + i * interval '1 ms', repeat('a', 64), 'processed' "
                "FROM generate_series(0, :n - 1) AS i"
            ),
            {"cutoff": CUTOFF, "n": YOUNG},
        )
    vacuum(engine, *(analyze or [table]), analyze=True)


def check(engine: Engine, table: str, tag: str, deleted: int, rows: int) -> None:
    """Every expired row deleted, every younger one kept; then the younger ones go."""
    assert deleted == rows, f"deleted {deleted:,} rows, expected {rows:,}"
    with engine.begin() as conn:
        left = conn.execute(
            text(f"SELECT count(*) FROM {table} WHERE processed_at < :cutoff"), {"cutoff": CUTOFF}
        ).scalar_one()
        assert left == 0, f"{left:,} expired rows left in {table}"
        kept = conn.execute(
            text(
                f"DELETE FROM {table} WHERE processed_at >= :cutoff "
                "AND processed_at < CAST(:cutoff AS timestamptz) + interval '1 minute' "
                "AND message_id LIKE :young"
            ),
            {"cutoff": CUTOFF, "young": f"young-{tag}-%"},
        ).rowcount
        assert kept == YOUNG, f"{YOUNG - kept} younger rows deleted from {table}"


def vacuum(engine: Engine, *tables: str, analyze: bool = False) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for table in tables:
            conn.execute(text(f"VACUUM {'ANALYZE ' if analyze else ''}{table}"))


def row_size(engine: Engine, table: str) -> str:
    """A row as stored: the tuple, and heap and indexes per row (a probe fill, truncated)."""
    n = 20_000
    fill(engine, table, n, "probe")
    with engine.begin() as conn:
        tuple_bytes, heap, indexes = conn.execute(
            text(
                f"SELECT avg(pg_column_size(t.*)), pg_relation_size('{table}'), "
                f"pg_indexes_size('{table}') FROM {table} t"
            )
        ).one()
        conn.execute(text(f"TRUNCATE {table}"))
    total = n + YOUNG
    return (
        f"{float(tuple_bytes):.0f} B a tuple (64-char payload_hash); heap {heap / total:.0f} B "
        f"and indexes {indexes / total:.0f} B per row"
    )


def tagged() -> str:
    return uuid.uuid4().hex[:8]


# --------------------------------------------------------------------------- 1. batch deletes

PLAIN_DELETE = (
    "WITH gone AS (DELETE FROM {table} WHERE ctid = ANY(ARRAY("
    "SELECT ctid FROM {table} WHERE processed_at < %(cutoff)s AND processed_at >= %(lower)s "
    "ORDER BY processed_at LIMIT %(limit)s)) RETURNING processed_at) "
    "SELECT count(*), max(processed_at) FROM gone"
)


def plain_prune(dsn: str, table: str, batch: int) -> tuple[int, float]:
    """What Pruner does per batch, in plain psycopg: the oldest ``batch`` expired rows by the
    processed_at index, from where the last batch ended, deleted by ctid; one autocommit
    statement (its own transaction) a batch, prepared. Returns (rows, seconds)."""
    statement = PLAIN_DELETE.format(table=table)
    deleted = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        started = time.perf_counter()
        lower = EARLIEST
        while True:
            params = {"cutoff": CUTOFF, "lower": lower, "limit": batch}
            row = conn.execute(statement, params, prepare=True).fetchone()
            assert row is not None
            count, last = row
            deleted += count
            if count < batch or last is None:
                break
            lower = last  # rows at exactly this time that are left still qualify
        return deleted, time.perf_counter() - started


def bench_batches(
    engine: Engine, dsn: str, tables: Tables, args: argparse.Namespace
) -> dict[int, tuple[Series, Series, Series]]:
    """Per batch size: (Pruner rows/s, Pruner seconds, plain psycopg rows/s)."""
    table = tables.processed_events.fullname
    results = {
        size: (
            Series(f"Pruner, batch {size:,}", "rows/s"),
            Series(f"Pruner, batch {size:,}", "s", higher_is_better=False),
            Series(f"plain psycopg, batch {size:,}", "rows/s"),
        )
        for size in args.batch_sizes
    }
    configs = [(size, plain) for size in args.batch_sizes for plain in (False, True)]
    for r in range(args.rounds):
        for size, plain in configs if r % 2 == 0 else configs[::-1]:
            tag = tagged()
            fill(engine, table, args.rows, tag)
            if plain:
                deleted, seconds = plain_prune(dsn, table, size)
            else:
                started = time.perf_counter()
                deleted = pruner(engine, tables, batch_size=size).prune()
                seconds = time.perf_counter() - started
            check(engine, table, tag, deleted, args.rows)
            vacuum(engine, table)
            rate, took, plain_rate = results[size]
            if plain:
                plain_rate.add(deleted / seconds)
            else:
                rate.add(deleted / seconds)
                took.add(seconds)
    print(f"1. PostgreSQL batch deletes of {args.rows:,} rows: Pruner and plain psycopg")
    print_table(
        "rows pruned per second",
        [s for size in args.batch_sizes for s in (results[size][0], results[size][2])],
    )
    print_table("seconds per prune (Pruner)", [results[size][1] for size in args.batch_sizes])
    ratios = ", ".join(
        f"batch {size:,}: {results[size][0].ratio(results[size][2]):.2f}x"
        for size in args.batch_sizes
    )
    print(f"  Pruner / plain psycopg (ratio of medians): {ratios}")
    print()
    return results


# --------------------------------------------------------------------------- 2. a live consumer


class Consumer:
    """Deduplicator batches of 10 messages in a thread; every batch's end and duration."""

    def __init__(self, engine: Engine, tables: Tables, ledger: str) -> None:
        dedup = Deduplicator(engine, consumer="ledger", tables=tables)

        @dedup.handler
        def credit(message: Message, session: Any) -> None:
            session.execute(text(f"INSERT INTO {ledger} VALUES (:id, 1)"), {"id": message.id})

        self.handler = credit
        self.batches: list[tuple[float, float]] = []  # (end, seconds)
        self.halt = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self, warm_up: float = 1.0) -> None:
        self.halt.clear()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()
        time.sleep(warm_up)

    def stop(self) -> None:
        self.halt.set()
        if self.thread is not None:
            self.thread.join()

    def run(self) -> None:
        while not self.halt.is_set():
            messages = [Message(id=f"live-{uuid.uuid4().hex}", body=BODY) for _ in range(10)]
            started = time.perf_counter()
            self.handler.process_batch(messages)
            ended = time.perf_counter()
            self.batches.append((ended, ended - started))

    def window(self, start: float, end: float) -> tuple[float, float, float]:
        """messages/s, median and max batch latency (ms) of the batches ended in [start, end]."""
        inside = [seconds for at, seconds in self.batches if start <= at <= end]
        if not inside:
            return 0.0, float("nan"), float("nan")
        rate = len(inside) * 10 / (end - start)
        return rate, statistics.median(inside) * 1000, max(inside) * 1000


def lower(name: str, unit: str) -> Series:
    """A series where less is better (a latency, a duration)."""
    return Series(name, unit, higher_is_better=False)


class Impact:
    """One case's per-round figures: the consumer alone just before, then during."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.alone = Series(f"consumer alone, before {label}", "msg/s")
        self.during = Series(f"consumer during {label}", "msg/s")
        self.share = Series(f"consumer during {label}, % of alone", "%")
        self.alone_median = lower(f"median batch, alone before {label}", "ms")
        self.during_median = lower(f"median batch, during {label}", "ms")
        self.alone_max = lower(f"worst batch, alone before {label}", "ms")
        self.during_max = lower(f"worst batch, during {label}", "ms")
        self.pruner = Series(f"pruner during {label} (consumer running)", "rows/s")
        self.window = lower(f"window ({label})", "s")

    def add(self, consumer: Consumer, start: float, end: float, baseline: float) -> None:
        """The prune ran over [start, end]; alone is a window as long, just before it."""
        length = min(end - start, baseline)
        alone = consumer.window(start - length, start)
        during = consumer.window(start, end)
        self.alone.add(alone[0])
        self.during.add(during[0])
        self.share.add(100 * during[0] / alone[0] if alone[0] else float("nan"))
        self.alone_median.add(alone[1])
        self.during_median.add(during[1])
        self.alone_max.add(alone[2])
        self.during_max.add(during[2])
        self.window.add(end - start)


def bench_consumer(engine: Engine, tables: Tables, args: argparse.Namespace) -> None:
    table = tables.processed_events.fullname
    ledger = f"{tables.processed_events.schema}.ledger"
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {ledger} (message_id TEXT, amount INTEGER)"))
    cases = {pause: Impact(f"prune, batch_pause={durations.render(pause)}") for pause in PAUSES}
    consumer = Consumer(engine, tables, ledger)
    consumer.start()
    try:
        for r in range(args.rounds):
            for pause in PAUSES if r % 2 == 0 else PAUSES[::-1]:
                tag = tagged()
                fill(engine, table, args.rows, tag)
                time.sleep(args.baseline)  # the consumer alone
                start = time.perf_counter()
                deleted = pruner(engine, tables, batch_pause=pause).prune()
                end = time.perf_counter()
                check(engine, table, tag, deleted, args.rows)
                case = cases[pause]
                case.add(consumer, start, end, args.baseline)
                case.pruner.add(deleted / (end - start))
                vacuum(engine, table)
    finally:
        consumer.stop()
    print(
        f"2. a consumer (Deduplicator, 10 messages a transaction) while Pruner deletes "
        f"{args.rows:,} rows (batch 5,000); alone = the same consumer just before, "
        f"over a window as long as the prune (at most {args.baseline:g} s)"
    )
    impacts = [cases[p] for p in PAUSES]
    print_table(
        "consumer throughput",
        [s for c in impacts for s in (c.alone, c.during, c.share)],
    )
    print_table(
        "consumer batch latency (10 messages)",
        [s for c in impacts for s in (c.alone_median, c.during_median, c.alone_max, c.during_max)],
    )
    print_table("the pruner, the consumer running", [c.pruner for c in impacts])
    print_table("the prune's length (the windows)", [c.window for c in impacts])


# --------------------------------------------------------------------------- 3. partitions


def make_days(engine: Engine, days: DayPartitions) -> None:
    """The day partitions fill() writes into: DAYS whole days before DAY_ZERO, DAY_ZERO's day
    and the next (the younger rows)."""
    with engine.begin() as conn:
        days.ensure(conn, (DAY_ZERO - timedelta(days=DAYS)).date(), DAYS + 2)


def fill_days(engine: Engine, tables: Tables, days: DayPartitions, rows: int, tag: str) -> None:
    """make_days() and fill(), vacuuming and analyzing only the filled days.

    An ANALYZE of the whole partitioned table would also record today's empty
    partition as empty: the consumers' cached generic plans then scan it
    sequentially until autovacuum analyzes it again (README: Partitioned).
    """
    make_days(engine, days)
    first = (DAY_ZERO - timedelta(days=DAYS)).date()
    filled = [days.qualified(days.name_for(first + timedelta(days=k))) for k in range(DAYS + 2)]
    fill(engine, tables.processed_events.fullname, rows, tag, analyze=filled)


def drop_days(engine: Engine, tables: Tables, rows: int, tag: str) -> tuple[int, float, float]:
    """One Pruner round on the partitioned table: (rows, start, end)."""
    start = time.perf_counter()
    report = pruner(engine, tables).run_once()
    end = time.perf_counter()
    assert len(report.partitions) == DAYS, report.partitions
    check(engine, tables.processed_events.fullname, tag, report.total, rows)
    return report.total, start, end


def bench_partitions(
    engine: Engine,
    schema: str,
    batches: dict[int, tuple[Series, Series, Series]],
    args: argparse.Namespace,
) -> None:
    """The same rows in processed_events partitioned by day (Tables.define(partitioned=True))."""
    tables = Tables.define(f"{schema}.pe_by_day", f"{schema}.ob_by_day", partitioned=True)
    install(engine, tables)
    days = DayPartitions(tables.processed_events)
    ledger = f"{schema}.ledger_by_day"
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {ledger} (message_id TEXT, amount INTEGER)"))
    drops = Series("Pruner, partition drops", "rows/s")
    drop_seconds = Series("Pruner, partition drops", "s", higher_is_better=False)
    impact = Impact("drops")
    consumer = Consumer(engine, tables, ledger)
    for r in range(args.rounds):
        for with_consumer in (False, True) if r % 2 == 0 else (True, False):
            tag = tagged()
            make_days(engine, days)  # before the consumer: DDL waits for no one
            if with_consumer:
                consumer.start()
            try:
                fill_days(engine, tables, days, args.rows, tag)
                if with_consumer:
                    time.sleep(args.baseline)
                deleted, start, end = drop_days(engine, tables, args.rows, tag)
                if with_consumer:
                    time.sleep(0.2)  # a batch that waited on a drop ends after it: count it in
                    impact.add(consumer, start, end + 0.2, args.baseline)
                    impact.pruner.add(deleted / (end - start))
                else:
                    drops.add(deleted / (end - start))
                    drop_seconds.add(end - start)
            finally:
                consumer.stop()
    best = max(args.batch_sizes, key=lambda size: batches[size][0].median)
    best_rate, best_seconds, _ = batches[best]
    print(
        f"3. a partitioned processed_events (Tables.define(partitioned=True)): the same "
        f"{args.rows:,} rows as {DAYS} day partitions, dropped by Pruner (rows counted "
        "per consumer before each drop)"
    )
    print_table(
        "drops against the best batch delete of 1.",
        [best_rate, drops],
        baseline=best_rate,
        baseline_label="vs batch",
    )
    print_table(
        "seconds per prune",
        [best_seconds, drop_seconds],
        baseline=best_seconds,
        baseline_label="vs batch",
    )
    print(
        "  the consumer of 2. on the partitioned table, alone just before the drops "
        "and during them (same-length windows: the drops + 0.2 s)"
    )
    print_table(
        "consumer on the partitioned table",
        [
            impact.alone,
            impact.during,
            impact.alone_median,
            impact.during_median,
            impact.alone_max,
            impact.during_max,
            impact.pruner,
        ],
    )


# --------------------------------------------------------------------------- 4. SQLite


def sqlite_engine(folder: str) -> tuple[Engine, Tables, str]:
    engine = create_engine(f"sqlite:///{folder}/bench.db")
    with engine.connect() as conn:
        conn.exec_driver_sql("PRAGMA journal_mode=WAL")
        mode = conn.exec_driver_sql("PRAGMA journal_mode").scalar()
        sync = conn.exec_driver_sql("PRAGMA synchronous").scalar()
    tables = Tables.define()
    install(engine, tables)
    setting = f"journal_mode={mode} synchronous={SQLITE_SYNCHRONOUS.get(int(sync), sync)}"
    return engine, tables, setting


def bench_sqlite(engine: Engine, tables: Tables, args: argparse.Namespace) -> None:
    pe = tables.processed_events
    rate = Series("Pruner, batch 5,000", "rows/s")
    for _ in range(args.rounds):
        tag = tagged()
        rows = [
            {
                "consumer": "ledger",
                "message_id": f"old-{tag}-{i}",
                "processed_at": DAY_ZERO - timedelta(days=1 + i % DAYS, milliseconds=i),
                "payload_hash": "a" * 64,
                "outcome": "processed",
            }
            for i in range(args.sqlite_rows)
        ] + [
            {
                "consumer": "ledger",
                "message_id": f"young-{tag}-{i}",
                "processed_at": CUTOFF + timedelta(milliseconds=i),
                "payload_hash": "a" * 64,
                "outcome": "processed",
            }
            for i in range(YOUNG)
        ]
        with engine.begin() as conn:
            conn.execute(pe.insert(), rows)
        started = time.perf_counter()
        deleted = pruner(engine, tables).prune()
        seconds = time.perf_counter() - started
        assert deleted == args.sqlite_rows, deleted
        with engine.begin() as conn:
            left = conn.execute(pe.select().where(pe.c.processed_at < CUTOFF)).all()
            assert not left, f"{len(left)} expired rows left"
            kept = conn.execute(pe.delete().where(pe.c.message_id.like(f"young-{tag}-%")))
            assert kept.rowcount == YOUNG, f"{YOUNG - kept.rowcount} younger rows deleted"
        rate.add(deleted / seconds)
    print(f"4. SQLite batch deletes of {args.sqlite_rows:,} rows (a file on local disk)")
    print_table("rows pruned per second", [rate])


# --------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=500_000, help="expired rows per round")
    parser.add_argument("--batch-sizes", default="1000,5000,20000")
    parser.add_argument("--sqlite-rows", type=int, default=200_000)
    parser.add_argument(
        "--baseline", type=float, default=4.0, help="seconds of the consumer alone per round"
    )
    add_round_arguments(parser)
    args = parser.parse_args()
    check_rounds(parser, args)
    conditions = Conditions()  # first: is the machine idle before we load it?
    if args.quick:
        args.rows, args.batch_sizes, args.sqlite_rows, args.baseline = 100_000, "5000", 20_000, 2.0
    args.batch_sizes = [int(s) for s in args.batch_sizes.split(",")]
    url = os.environ.get("CONSUMERDEDUP_BENCH_PG_URL", DEFAULT_URL)
    engine = create_engine(url, pool_size=4)
    dsn = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    schema = f"bench_prune_{uuid.uuid4().hex[:8]}"
    tables = Tables.define(f"{schema}.processed_events", f"{schema}.outbox")
    folder = tempfile.mkdtemp(prefix="consumerdedup-bench-")
    lite, lite_tables, lite_setting = sqlite_engine(folder)
    begun = time.perf_counter()
    try:
        install(engine, tables)
        conditions.postgres(engine)
        conditions.add(
            "workload",
            f"{args.rows:,} expired rows per round over {DAYS} whole days, and {YOUNG:,} "
            "younger ones that must stay; retention 7 days + 1 day buffer, the clock pinned",
        )
        conditions.add("row size", row_size(engine, tables.processed_events.fullname))
        conditions.add(
            "batch sizes",
            f"{', '.join(f'{s:,}' for s in args.batch_sizes)} (1.); the default 5,000 (2.-4.)",
        )
        conditions.add(
            "consumer",
            f"Deduplicator, 10 messages a transaction, {len(BODY)}-byte bodies, one business "
            "INSERT each, in a thread of this process; no broker (the handler is called "
            "directly)",
        )
        conditions.add(
            "SQLite",
            f"{sqlite3.sqlite_version}, {lite_setting}, a file in {folder}, "
            f"{args.sqlite_rows:,} rows per round",
        )
        conditions.add(
            "rounds",
            f"{args.rounds} per configuration, round-robin (the order reverses every other "
            "round); the prunes of 1. and the drops of 3. run with nothing else of ours",
        )
        conditions.print()
        batches = bench_batches(engine, dsn, tables, args)
        bench_consumer(engine, tables, args)
        bench_partitions(engine, schema, batches, args)
        bench_sqlite(lite, lite_tables, args)
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
        engine.dispose()
        lite.dispose()
        shutil.rmtree(folder, ignore_errors=True)
    print(f"The run took {time.perf_counter() - begun:.0f} s.")
    conditions.print_after()
    return 0


if __name__ == "__main__":
    sys.exit(main())
