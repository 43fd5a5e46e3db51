"""The dedup pipeline on MariaDB/MySQL against plain PyMySQL doing the same statements, in
the same run: per message, ``.batch(500)`` and a bulk handler over 500.

Run: ``.venv/bin/python bench/bench_mysql.py`` (``--rounds N``, at least 3; ``--quick``: one
small round, a smoke run). Needs MariaDB 10.6+ or MySQL 8.0.1+
(``CONSUMERDEDUP_BENCH_MYSQL_URL``, default root@127.0.0.1:3306); it makes a database of
its own and drops it at the end.

Each message: a claim in processed_events, one ledger row, COMMIT. What each side sends:

- per message. consumerdedup: the claim (INSERT of one row; its 1062 would mean
  DUPLICATE), the handler's INSERT, the claim check (SELECT count(*) of the attempt's
  claims: the last statement before COMMIT on MySQL), COMMIT. Plain: the same four
  statements through PyMySQL's own cursor, no SQLAlchemy.
- batch 500. consumerdedup ``.batch()``: one multi-row claim, 500 handler INSERTs, the
  claim check, one COMMIT. Plain: the same.
- bulk 500. consumerdedup ``bulk_handler``: one multi-row claim, one multi-row INSERT of
  the 500 ledger rows by the handler, the claim check, one COMMIT. Plain: the same.

Configurations run round-robin, ``--rounds`` times, the tables emptied before each (not
timed); a figure is the median of the rounds with their spread (min-max), a ratio the
ratio of two medians (bench/measure.py). Checks (a miss exits with status 1): every
message PROCESSED, one ledger row and one record each.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from consumerdedup import Deduplicator, Message, Outcome, Tables, install

sys.path.insert(0, os.path.dirname(__file__))
from measure import (
    MIN_ROUNDS,
    Conditions,
    Series,
    add_round_arguments,
    check_rounds,
    print_pairs,
    print_table,
)
from plain_sql import describe_mysql, mysql_database, plain_mysql

BATCH = 500
KINDS = ("per message", f"batch {BATCH}", f"bulk {BATCH}")


class Failure(SystemExit):
    def __init__(self, message: str) -> None:
        super().__init__(f"BENCH FAILED: {message}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_round_arguments(parser)
    parser.add_argument("--messages", type=int, default=2000, help="messages a configuration")
    args = parser.parse_args()
    check_rounds(parser, args)
    if args.quick:
        args.messages = BATCH
    conditions = Conditions()
    with mysql_database() as (engine, url):
        tables = install_tables(engine)
        describe_mysql(conditions, engine)
        conditions.add(
            "workload",
            f"{args.messages} new messages a configuration and round (64-byte bodies), one "
            "ledger row each; REPEATABLE READ (the server's default); one connection",
        )
        conditions.print()
        run(engine, url, tables, args)
    conditions.print_after()


def install_tables(engine: Any) -> Tables:
    """The library's tables, the handler's ledger and plain PyMySQL's own processed_events."""
    tables = Tables.define()
    install(engine, tables)
    with engine.begin() as conn:
        conn.execute(
            text(
                "CREATE TABLE ledger (account VARCHAR(64), amount INTEGER, "
                "message_id VARCHAR(255)) ENGINE=InnoDB"
            )
        )
        conn.execute(text("CREATE TABLE plain_events LIKE processed_events"))
    return tables


def messages(count: int, round_: int) -> list[Message]:
    return [
        Message(id=f"r{round_}-m{i:06d}", body=hashlib.sha256(str(i).encode()).hexdigest().encode())
        for i in range(count)
    ]


def empty(engine: Any) -> None:
    with engine.begin() as conn:
        for table in ("ledger", "processed_events", "plain_events"):
            conn.exec_driver_sql(f"DELETE FROM {table}")


def timed_dedup(engine: Any, tables: Tables, kind: str, batch: list[Message]) -> float:
    dedup = Deduplicator(engine, consumer="bench", tables=tables)
    # Every value a parameter: PyMySQL's executemany then sends one multi-row INSERT (it
    # rewrites only a VALUES tuple of placeholders; ('a', 1, :m) went row by row).
    insert_one = text("INSERT INTO ledger (account, amount, message_id) VALUES (:a, :n, :m)")

    @dedup.handler
    def one(message: Message, session: Session) -> None:
        session.execute(insert_one, {"a": "a", "n": 1, "m": message.id})

    @dedup.bulk_handler
    def bulk(new: list[Message], session: Session) -> None:
        session.execute(insert_one, [{"a": "a", "n": 1, "m": m.id} for m in new])

    started = time.perf_counter()
    if kind == "per message":
        outcomes = [one(message) for message in batch]
    else:
        handler = one if kind.startswith("batch") else bulk
        outcomes = []
        for start in range(0, len(batch), BATCH):
            outcomes += handler.batch(batch[start : start + BATCH])
    elapsed = time.perf_counter() - started
    if outcomes != [Outcome.PROCESSED] * len(batch):
        raise Failure(f"consumerdedup {kind}: not every message PROCESSED")
    return elapsed


def timed_plain(url: Any, kind: str, batch: list[Message]) -> float:
    """The statements consumerdedup sends, by hand: claim, handler writes, check, COMMIT."""
    conn = plain_mysql(url)
    claim_cols = "(consumer, message_id, processed_at, payload_hash, outcome, error)"
    ledger = "INSERT INTO ledger (account, amount, message_id) VALUES (%s, %s, %s)"
    try:
        with conn.cursor() as cursor:
            started = time.perf_counter()
            size = 1 if kind == "per message" else BATCH
            for start in range(0, len(batch), size):
                chunk = batch[start : start + size]
                stamp = datetime.now(UTC).replace(tzinfo=None)
                rows = [
                    ("bench", m.id, stamp, hashlib.sha256(m.body).hexdigest(), "processed", None)
                    for m in sorted(chunk, key=lambda m: m.id)
                ]
                values = ", ".join(["(%s, %s, %s, %s, %s, %s)"] * len(rows))
                cursor.execute(
                    f"INSERT INTO plain_events {claim_cols} VALUES {values}",
                    [v for row in rows for v in row],
                )
                if kind.startswith("bulk"):
                    cursor.executemany(ledger, [("a", 1, m.id) for m in chunk])
                else:
                    for m in chunk:
                        cursor.execute(ledger, ("a", 1, m.id))
                marks = ", ".join(["%s"] * len(chunk))
                cursor.execute(
                    "SELECT count(*) FROM plain_events WHERE consumer = %s AND message_id IN "
                    f"({marks}) AND processed_at = %s AND outcome = 'processed' "
                    "AND error IS NULL",
                    ["bench", *[m.id for m in chunk], stamp],
                )
                if cursor.fetchone()[0] != len(chunk):
                    raise Failure(f"plain {kind}: the claim check came up short")
                conn.commit()
            return time.perf_counter() - started
    finally:
        conn.close()


def check(engine: Any, name: str, table: str, count: int) -> None:
    with engine.connect() as conn:
        ledger = conn.exec_driver_sql("SELECT count(DISTINCT message_id), count(*) FROM ledger")
        distinct, rows = ledger.one()
        records = conn.exec_driver_sql(f"SELECT count(*) FROM {table}").scalar()
    if not distinct == rows == records == count:
        raise Failure(f"{name}: {rows} ledger rows ({distinct} ids), {records} records")


def run(engine: Any, url: Any, tables: Tables, args: argparse.Namespace) -> None:
    ours = {k: Series(f"consumerdedup {k}") for k in KINDS}
    plain = {k: Series(f"plain PyMySQL {k}") for k in KINDS}
    for round_ in range(args.rounds):
        batch = messages(args.messages, round_)
        for kind in KINDS:
            empty(engine)
            seconds = timed_dedup(engine, tables, kind, batch)
            check(engine, f"consumerdedup {kind}", "processed_events", len(batch))
            ours[kind].add(len(batch) / seconds)
            empty(engine)
            seconds = timed_plain(url, kind, batch)
            check(engine, f"plain {kind}", "plain_events", len(batch))
            plain[kind].add(len(batch) / seconds)
    print_table("Throughput (messages/s)", [s for k in KINDS for s in (ours[k], plain[k])])
    note = "" if args.rounds >= MIN_ROUNDS else " (SMOKE RUN, not a measurement)"
    print_pairs(
        f"Like with like: consumerdedup / plain PyMySQL, same statements, same run{note}",
        [(kind, ours[kind], plain[kind]) for kind in KINDS],
    )


if __name__ == "__main__":
    main()
