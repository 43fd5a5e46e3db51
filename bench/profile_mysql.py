"""Where a message's time goes in the pipeline on MariaDB/MySQL: statements sent, CPU.

Run: ``.venv/bin/python bench/profile_mysql.py`` (``CONSUMERDEDUP_BENCH_MYSQL_URL``, default
root@127.0.0.1:3306; a database of its own, dropped at the end; ``--profile KIND``: a cProfile
of that kind's run, top functions by own and cumulative time). For each of per message,
``.batch(500)`` and bulk 500, the pipeline and plain PyMySQL (bench_mysql's two sides):

- statements a message: every request PyMySQL sends (``Connection.query``, COMMIT and
  ROLLBACK included: one round trip each), counted, with the statements' first words;
- client CPU a message (``getrusage`` over the run, no profiler), user and system apart:
  user time is the Python side (ours, SQLAlchemy's, PyMySQL's), system time mostly the
  socket calls (so it grows with round trips); what a loaded machine distorts least, read
  it as where the time goes, not as a rate. Median of ``--rounds`` runs, the two sides
  interleaved.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import resource
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from statistics import median
from typing import Any

import pymysql

from consumerdedup import Tables

sys.path.insert(0, os.path.dirname(__file__))
from bench_mysql import BATCH, KINDS, empty, install_tables, messages, timed_dedup, timed_plain
from plain_sql import mysql_database

ROUNDS = 5


@contextmanager
def counted() -> Iterator[collections.Counter[str]]:
    """Count what PyMySQL sends (each ``query`` and each commit/rollback is a round trip)."""
    seen: collections.Counter[str] = collections.Counter()
    connection = pymysql.connections.Connection
    query, commit, rollback = connection.query, connection.commit, connection.rollback

    def counting_query(self: Any, sql: Any, unbuffered: bool = False) -> Any:
        words = (sql if isinstance(sql, str) else bytes(sql).decode()).split(None, 3)
        seen[" ".join(words[: 3 if words[0].upper() == "INSERT" else 1]).upper()] += 1
        return query(self, sql, unbuffered)

    def counting(name: str, real: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def call(self: Any) -> Any:
            seen[name] += 1
            return real(self)

        return call

    connection.query = counting_query  # type: ignore[method-assign]
    connection.commit = counting("COMMIT", commit)  # type: ignore[method-assign]
    connection.rollback = counting("ROLLBACK", rollback)  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        connection.query, connection.commit, connection.rollback = query, commit, rollback  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--profile", choices=KINDS, help="cProfile this kind's pipeline run")
    args = parser.parse_args()
    with mysql_database("profile") as (engine, url):
        tables = install_tables(engine)
        if args.profile:
            profile(engine, tables, args)
        else:
            measure(engine, url, tables, args)


def measure(engine: Any, url: Any, tables: Tables, args: argparse.Namespace) -> None:
    count = args.messages
    print(f"{count} messages a run; CPU a message: median of {args.rounds} runs, interleaved")
    print(f"  {'configuration':<32} {'stmts/msg':>10} {'user us':>9} {'sys us':>9}  sent")
    for kind in KINDS:
        sides: dict[str, Callable[[list[Any]], Any]] = {
            "consumerdedup": lambda b, k=kind: timed_dedup(engine, tables, k, b),
            "plain PyMySQL": lambda b, k=kind: timed_plain(url, k, b),
        }
        cpu: dict[str, list[float]] = {side: [] for side in sides}
        sys_cpu: dict[str, list[float]] = {side: [] for side in sides}
        sent: dict[str, collections.Counter[str]] = {}
        for round_ in range(args.rounds):
            batch = messages(count, round_)
            for side, run in sides.items():
                empty(engine)
                with counted() as seen:
                    before = resource.getrusage(resource.RUSAGE_SELF)
                    run(batch)
                    after = resource.getrusage(resource.RUSAGE_SELF)
                cpu[side].append(after.ru_utime - before.ru_utime)
                sys_cpu[side].append(after.ru_stime - before.ru_stime)
                sent[side] = seen
        for side in sides:
            user = median(cpu[side]) / count * 1e6
            kernel = median(sys_cpu[side]) / count * 1e6
            total = sum(sent[side].values()) / count
            what = ", ".join(f"{n} {w}" for w, n in sent[side].most_common())
            print(f"  {side + ' ' + kind:<32} {total:>10.3f} {user:>9.1f} {kernel:>9.1f}  {what}")


def profile(engine: Any, tables: Tables, args: argparse.Namespace) -> None:
    batch = messages(args.messages, 0)
    empty(engine)
    timed_dedup(engine, tables, args.profile, messages(BATCH, 99))  # warm: caches, pool
    empty(engine)
    profiler = cProfile.Profile()
    profiler.enable()
    timed_dedup(engine, tables, args.profile, batch)
    profiler.disable()
    stats = pstats.Stats(profiler).strip_dirs()
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(45)


if __name__ == "__main__":
    main()
