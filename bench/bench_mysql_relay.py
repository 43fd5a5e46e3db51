"""The outbox relay on MariaDB/MySQL against a hand-written PyMySQL relay doing the same
statements' work, in the same run.

Run: ``.venv/bin/python bench/bench_mysql_relay.py`` (``--rounds N``, at least 3; ``--quick``:
one small round, a smoke run). Needs MariaDB 10.6+ or MySQL 8.0.1+
(``CONSUMERDEDUP_BENCH_MYSQL_URL``, default root@127.0.0.1:3306); it makes a database of
its own and drops it at the end. Target: MemoryBroker (no network), so the ratio prices
the relay's SQL and bookkeeping alone.

Per round and configuration: the outbox emptied (DELETE), N events added by Outbox.add
(untimed; ``--keys`` keys, ``--body-size`` bytes, ANALYZE TABLE), then the drain timed:
from just before its first round until a round finds nothing (the last marks committed).

- relay: ``OutboxRelay.drain()`` at batch_size 100 and 500 (a fresh relay each time). Each
  round is one READ COMMITTED transaction: the scan of rows that may go (backoff and
  hold-back filters, 4 batches' worth, no lock), ``SELECT ... WHERE id IN (...) ORDER BY
  id LIMIT batch FOR UPDATE SKIP LOCKED`` by the primary key, the publishes, ``UPDATE ...
  SET published_at, last_error = NULL WHERE id IN (...)``, COMMIT.
- plain: PyMySQL by hand (no SQLAlchemy), READ COMMITTED, the same batch sizes: ``SELECT
  id, event_id, destination, key, body, headers, attempts ... WHERE published_at IS NULL
  ORDER BY id LIMIT n FOR UPDATE SKIP LOCKED`` (the relay's columns and order; no per-key
  order across relays, no backoff or parked filter), MemoryBroker.publish per row (headers
  decoded from JSON, as the relay's), the same UPDATE, COMMIT; until a SELECT finds none.

Configurations run round-robin, ``--rounds`` times; a figure is the median of the rounds
with their spread (min-max), a ratio the ratio of two medians (bench/measure.py). The
conditions block (CPU, idle or not, the server's version and durability settings, commit
latency) comes first.

Checks (a miss exits with status 1): each drain publishes its N, each event once (by
event_id); backlog 0 afterwards, nothing parked.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.orm import Session

from consumerdedup import Outbox, OutboxRelay, RelayConfig, Tables, install
from consumerdedup.headers import ID_HEADER
from consumerdedup.testing import MemoryBroker

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

BATCH_SIZES = (100, 500)


class Failure(SystemExit):
    def __init__(self, message: str) -> None:
        super().__init__(f"BENCH FAILED: {message}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_round_arguments(parser)
    parser.add_argument("--events", type=int, default=5000, help="events per drain")
    parser.add_argument("--keys", type=int, default=100, help="distinct keys")
    parser.add_argument("--body-size", type=int, default=256, help="bytes per event body")
    args = parser.parse_args()
    check_rounds(parser, args)
    if args.quick:
        args.events = 500
    conditions = Conditions()
    with mysql_database() as (engine, url):
        tables = Tables.define()
        install(engine, tables)
        describe_mysql(conditions, engine)
        conditions.add(
            "workload",
            f"{args.events} events a drain, {args.keys} keys, {args.body_size}-byte bodies; "
            "target MemoryBroker (no network)",
        )
        conditions.print()
        run(engine, url, tables, args)
    conditions.print_after()


def fill(engine: Any, tables: Tables, args: argparse.Namespace, before: Any = None) -> None:
    """An empty outbox (``before()`` runs then), then ``args.events`` events."""
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DELETE FROM {tables.outbox.name}")
    if before is not None:
        before()
    outbox = Outbox(tables)
    body = b"x" * args.body_size
    for start in range(0, args.events, 500):
        with Session(engine) as session, session.begin():
            for n in range(start, min(start + 500, args.events)):
                outbox.add(session, "orders", body, key=f"k{n % args.keys}")
    with engine.connect() as conn:
        conn.exec_driver_sql(f"ANALYZE TABLE {tables.outbox.name}").all()


def timed_relay(
    engine: Any, tables: Tables, batch: int, args: argparse.Namespace
) -> tuple[float, Any]:
    """A fresh relay: its start checks on the empty outbox (untimed), the fill, the drain."""
    broker = MemoryBroker()
    with OutboxRelay(engine, broker, tables=tables, config=RelayConfig(batch_size=batch)) as relay:
        fill(engine, tables, args, before=relay.drain)
        started = time.perf_counter()
        published = relay.drain()
        elapsed = time.perf_counter() - started
        if published != args.events or relay.backlog() != 0 or relay.parked():
            raise Failure(f"relay batch {batch}: published {published} of {args.events}")
    return elapsed, broker


def timed_plain(url: Any, table: str, batch: int, events: int) -> tuple[float, Any]:
    broker = MemoryBroker()
    conn = plain_mysql(url)
    claim = (
        "SELECT id, event_id, destination, `key`, body, headers, attempts FROM "
        f"{table} WHERE published_at IS NULL ORDER BY id LIMIT {batch} FOR UPDATE SKIP LOCKED"
    )
    try:
        with conn.cursor() as cursor:
            cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
            started = time.perf_counter()
            while True:
                cursor.execute(claim)
                rows = cursor.fetchall()
                if not rows:
                    conn.commit()
                    break
                for _id, event_id, destination, key, body, headers, _attempts in rows:
                    decoded = json.loads(headers)
                    decoded[ID_HEADER] = event_id
                    broker.publish(destination, body, key, decoded)
                marks = ", ".join(["%s"] * len(rows))
                cursor.execute(
                    f"UPDATE {table} SET published_at = %s, last_error = NULL "
                    f"WHERE id IN ({marks})",
                    [datetime.now(UTC).replace(tzinfo=None), *[row[0] for row in rows]],
                )
                conn.commit()
            elapsed = time.perf_counter() - started
            cursor.execute(f"SELECT count(*) FROM {table} WHERE published_at IS NULL")
            (left,) = cursor.fetchone()
    finally:
        conn.close()
    if left:
        raise Failure(f"plain batch {batch}: {left} rows left unpublished")
    return elapsed, broker


def check_broker(name: str, broker: MemoryBroker, events: int) -> None:
    ids = Counter(message.id for message in broker.messages("orders"))
    if len(ids) != events or any(count != 1 for count in ids.values()):
        raise Failure(f"{name}: {sum(ids.values())} messages for {len(ids)} of {events} events")


def run(engine: Any, url: Any, tables: Tables, args: argparse.Namespace) -> None:
    relay = {b: Series(f"relay batch {b}") for b in BATCH_SIZES}
    plain = {b: Series(f"plain PyMySQL batch {b}") for b in BATCH_SIZES}
    for _ in range(args.rounds):
        for batch in BATCH_SIZES:
            seconds, broker = timed_relay(engine, tables, batch, args)
            check_broker(f"relay batch {batch}", broker, args.events)
            relay[batch].add(args.events / seconds)
            fill(engine, tables, args)
            seconds, broker = timed_plain(url, tables.outbox.name, batch, args.events)
            check_broker(f"plain batch {batch}", broker, args.events)
            plain[batch].add(args.events / seconds)
    print_table(
        "Drain throughput (events/s)",
        [s for b in BATCH_SIZES for s in (relay[b], plain[b])],
    )
    rounds = args.rounds
    note = "" if rounds >= MIN_ROUNDS else " (SMOKE RUN, not a measurement)"
    print_pairs(
        f"Relay / plain PyMySQL, same batch size, same run{note}",
        [(f"batch {b}", relay[b], plain[b]) for b in BATCH_SIZES],
    )


if __name__ == "__main__":
    main()
