"""What every benchmark shares: the conditions it ran under and how a figure is summed up.

A figure is the **median of at least three rounds**, printed with the slowest and fastest
round (the spread). Every configuration of a bench runs the same number of rounds,
round-robin, so slow drift of the machine (a checkpoint, autovacuum, another process)
falls on all of them alike. A ratio is the ratio of two medians from the same run.

``--quick`` runs one round: a smoke run that proves the bench works, not a measurement;
its tables say so. The conditions block says whether the CPUs were idle before the run,
because on a busy 2-core machine every figure is understated.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import psycopg
import sqlalchemy
from sqlalchemy import Engine

MIN_ROUNDS = 3
BUSY_LIMIT = 0.15  # share of all CPUs busy with other work above which a run is "not idle"
PG_SETTINGS = ("server_version", "synchronous_commit", "fsync", "wal_sync_method", "shared_buffers")


# --------------------------------------------------------------------------- rounds


def add_round_arguments(parser: argparse.ArgumentParser, rounds: int = MIN_ROUNDS) -> None:
    parser.add_argument(
        "--rounds", type=int, default=rounds, help=f"rounds per configuration (>= {MIN_ROUNDS})"
    )
    parser.add_argument(
        "--quick", action="store_true", help="one small round: a smoke run, not a measurement"
    )


def check_rounds(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A measurement needs three rounds at least; --quick is one round and says so."""
    if args.quick:
        args.rounds = 1
    elif args.rounds < MIN_ROUNDS:
        parser.error(f"--rounds must be at least {MIN_ROUNDS} (a median needs them)")


@dataclass
class Series:
    """One configuration's per-round figures (a rate or a duration), in run order."""

    name: str
    unit: str = "msg/s"
    values: list[float] = field(default_factory=list)
    higher_is_better: bool = True

    def add(self, value: float) -> None:
        self.values.append(value)

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    @property
    def spread(self) -> str:
        if not self.values:
            return "-"
        return f"{fmt(min(self.values))}-{fmt(max(self.values))}"

    def ratio(self, other: Series) -> float:
        """How many times better than ``other`` (medians; > 1 is better, whatever the unit)."""
        if not other.median or not self.median:
            return float("nan")
        if self.higher_is_better:
            return self.median / other.median
        return other.median / self.median


def fmt(value: float) -> str:
    if value != value:  # NaN
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def same_rounds(series: Iterable[Series]) -> None:
    counts = {len(s.values) for s in series}
    if len(counts) > 1:
        raise SystemExit(f"BENCH FAILED: configurations ran different round counts {counts}")


def print_table(
    title: str,
    series: Sequence[Series],
    baseline: Series | None = None,
    baseline_label: str = "vs base",
) -> None:
    """Median, spread and (if a baseline is given) the ratio of medians, one row each."""
    same_rounds([*series, *([baseline] if baseline else [])])
    rounds = len(series[0].values) if series else 0
    note = "median of" if rounds >= MIN_ROUNDS else "SMOKE RUN, not a measurement:"
    print(f"{title} ({note} {rounds} round{'s' if rounds != 1 else ''}; spread = min-max)")
    width = max(len(s.name) for s in series)
    header = f"  {'configuration':<{width}}  {'median':>10}  {'unit':<8} {'spread':>19}"
    if baseline is not None:
        header += f"  {baseline_label:>8}"
    print(header)
    print("  " + "-" * (len(header) - 2))
    for s in series:
        line = f"  {s.name:<{width}}  {fmt(s.median):>10}  {s.unit:<8} {s.spread:>19}"
        if baseline is not None:
            line += f"  {s.ratio(baseline):>7.2f}x"
        print(line)
    print()


def print_pairs(title: str, pairs: Sequence[tuple[str, Series, Series]]) -> None:
    """``ours / theirs`` per line: each ratio of medians from the same run, same rounds."""
    same_rounds(s for _, ours, theirs in pairs for s in (ours, theirs))
    print(title)
    width = max(len(label) for label, _, _ in pairs)
    for label, ours, theirs in pairs:
        print(
            f"  {label:<{width}}  {fmt(ours.median):>9} / {fmt(theirs.median):>9} "
            f"{ours.unit:<8} = {ours.ratio(theirs):.2f}x"
        )
    print()


def timed(started: float) -> float:
    return time.perf_counter() - started


# --------------------------------------------------------------------------- conditions


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_total() -> str:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    except OSError:
        pass
    return "unknown"


def load_average() -> str:
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "unknown"
    return f"{one:.2f} {five:.2f} {fifteen:.2f} (1, 5, 15 min)"


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies over all CPUs since boot, from /proc/stat."""
    try:
        with open("/proc/stat", encoding="utf-8") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def cpu_busy(seconds: float = 1.0) -> float | None:
    """The share of all CPUs busy over ``seconds`` while this process sleeps: other work."""
    before = _cpu_times()
    time.sleep(seconds)
    after = _cpu_times()
    if before is None or after is None or after[1] == before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def idle_text(busy: float | None) -> str:
    if busy is None:
        return "unknown (no /proc/stat)"
    state = "idle" if busy < BUSY_LIMIT else "NOT IDLE: figures understated"
    return f"{state} (CPUs {busy:.0%} busy over 1 s just before the run)"


def postgres_settings(engine: Engine) -> dict[str, str]:
    with engine.connect() as conn:
        return {name: str(conn.exec_driver_sql(f"SHOW {name}").scalar()) for name in PG_SETTINGS}


def commit_latency(engine: Engine, commits: int = 50) -> float:
    """Median ms of one tiny write transaction alone on the server (a round trip and a WAL
    flush): the floor under every per-transaction figure, and the part the disk decides."""
    table = f"bench_commit_{uuid.uuid4().hex[:10]}"
    times = []
    with engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        conn.exec_driver_sql(f"CREATE TABLE {table} (n int)")
        try:
            for n in range(commits):
                started = time.perf_counter()
                conn.exec_driver_sql(f"INSERT INTO {table} VALUES ({n})")
                times.append(time.perf_counter() - started)
        finally:
            conn.exec_driver_sql(f"DROP TABLE {table}")
    return statistics.median(times) * 1000


def libpq() -> str:
    version = psycopg.pq.version()
    return f"{version // 10000}.{version % 100}"


class Conditions:
    """The block every bench prints first: machine, idleness, servers, workload."""

    def __init__(self) -> None:
        self.busy = cpu_busy()  # before anything of ours runs
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        self.rows: list[tuple[str, str]] = [
            ("CPU", f"{os.cpu_count()} x {cpu_model()} ({usable or '?'} usable)"),
            ("memory", memory_total()),
            ("machine", idle_text(self.busy)),
            ("load", load_average()),
            ("OS", platform.platform()),
            (
                "Python",
                f"{platform.python_version()}; SQLAlchemy {sqlalchemy.__version__}; "
                f"psycopg {psycopg.__version__} (impl {psycopg.pq.__impl__}, libpq {libpq()})",
            ),
        ]

    @property
    def idle(self) -> bool:
        return self.busy is not None and self.busy < BUSY_LIMIT

    def add(self, key: str, value: str) -> None:
        self.rows.append((key, value))

    def postgres(self, engine: Engine) -> None:
        pg = postgres_settings(engine)
        self.add(
            "PostgreSQL",
            f"{pg['server_version']} on this machine: synchronous_commit="
            f"{pg['synchronous_commit']} fsync={pg['fsync']} "
            f"wal_sync_method={pg['wal_sync_method']} shared_buffers={pg['shared_buffers']}",
        )
        self.add(
            "  commit",
            f"{commit_latency(engine):.2f} ms for one write transaction alone (median of 50: "
            "a round trip and a WAL flush: the floor under every per-transaction figure)",
        )

    def print(self) -> None:
        width = max(len(k) for k, _ in self.rows)
        print("Conditions")
        for key, value in self.rows:
            print(f"  {key:<{width}}  {value}")
        print()

    def print_after(self) -> None:
        print(f"Load average after the run: {load_average()}")
        if not self.idle:
            print(f"WARNING: the machine was {idle_text(self.busy)}")
