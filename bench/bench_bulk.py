"""Bulk handlers on PostgreSQL, side by side with what a team would write by hand.

Run it: ``.venv/bin/python bench/bench_bulk.py`` (or ``make bench``); ``--quick`` for a
smoke run. It needs a PostgreSQL server (``CONSUMERDEDUP_BENCH_PG_URL``, default the local
``test`` database). Everything it writes lives in a fresh schema, dropped at the end.

Configurations, each on fresh message ids (every message really processed), 500 a
transaction, the same business table and the same processed_events:

- ``@dedup.bulk_handler``, blocking and asyncio: one multi-row claim, one ``executemany``
  of the business rows, one commit;
- plain psycopg: the same multi-row claim (``INSERT ... ON CONFLICT DO NOTHING RETURNING``),
  ``executemany`` of the claimed rows, commit; no SQLAlchemy, no checks;
- today's ``.batch(500)``: a per-message handler, one INSERT per message;
- two bulk consumers over overlapping keys (issue 20 item 6): each batch's 20 messages
  update 20 shared account rows and add an outbox event keyed by account, the two consumers
  in opposite orders; with the library's lock order and the updates sorted by key (no
  deadlock may happen), and as before (locks in delivery order: PostgreSQL deadlocks,
  each detected after deadlock_timeout, the loser retried). Deadlocks are counted as the
  40P01 errors the bench's own engine met.

Rounds run round-robin (``--rounds``, at least 3); a rate is the median of the rounds,
ratios are ratios of medians from this run (bench/measure.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import sessionmaker

from consumerdedup import AsyncDeduplicator, Deduplicator, Message, Outbox, Outcome, Tables, install
from consumerdedup.db import before_commit

sys.path.insert(0, os.path.dirname(__file__))
import plain_sql
from measure import Conditions, Series, add_round_arguments, check_rounds, print_pairs, print_table

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
BATCH = 500
PLAIN_TARGET = 0.7  # bulk handler / plain psycopg, at least
BATCH_TARGET = 5.0  # bulk handler / .batch(500), at least
BY_HAND = "ceiling: a plain Session by hand, 500"


def make_messages(tag: str, count: int) -> list[Message]:
    return [
        Message(id=f"{tag}-{i}", body=f'{{"account":"acct-{i % 97}","amount":{i % 1000}}}'.encode())
        for i in range(count)
    ]


def row(message: Message) -> dict[str, Any]:
    return {"account": message.id[-2:], "amount": len(message.body), "message_id": message.id}


def chunks(items: Sequence[Message], size: int) -> list[Sequence[Message]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class Bench:
    def __init__(self, args: argparse.Namespace, url: str) -> None:
        self.args = args
        self.url = url
        self.schema = f"bench_{uuid.uuid4().hex[:10]}"
        self.tag = uuid.uuid4().hex[:8]
        self.payments = f"{self.schema}.payments"
        self.accounts = f"{self.schema}.accounts"
        self.engine: Engine = create_engine(url, pool_size=4)
        self.tables = Tables.define(f"{self.schema}.processed_events", f"{self.schema}.outbox")
        self.insert = (
            f"INSERT INTO {self.payments} (account, amount, message_id) "
            "VALUES (:account, :amount, :message_id)"
        )

    def setup(self) -> None:
        install(self.engine, self.tables)
        with self.engine.begin() as conn:
            conn.execute(
                text(f"CREATE TABLE {self.payments} (account text, amount int, message_id text)")
            )
            conn.execute(text(f"CREATE TABLE {self.accounts} (id text PRIMARY KEY, balance int)"))

    def teardown(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE'))
        self.engine.dispose()

    # ---- the configurations: each takes a slice of messages and processes all of them

    def configurations(self) -> dict[str, Callable[[Sequence[Message]], None]]:
        insert = text(self.insert)
        dedup = Deduplicator(self.engine, consumer="bulk", tables=self.tables)

        @dedup.bulk_handler
        def bulk(messages: list[Message], session: Any) -> None:
            session.execute(insert, [row(m) for m in messages])

        per_message = Deduplicator(self.engine, consumer="batch", tables=self.tables)

        @per_message.handler
        def one(message: Message, session: Any) -> None:
            session.execute(insert, row(message))

        loop = asyncio.new_event_loop()
        self.loop = loop
        self.async_engine = create_async_engine(self.url, pool_size=4)
        adedup = AsyncDeduplicator(self.async_engine, consumer="abulk", tables=self.tables)

        @adedup.bulk_handler
        async def abulk(messages: list[Message], session: Any) -> None:
            await session.execute(insert, [row(m) for m in messages])

        raw = psycopg.connect(
            make_url(self.url).set(drivername="postgresql").render_as_string(False)
        )
        self.raw = raw
        claim = plain_sql.claim_many(f"{self.schema}.processed_events")
        raw_insert = (
            f"INSERT INTO {self.payments} (account, amount, message_id) "
            "VALUES (%(account)s, %(amount)s, %(message_id)s)"
        )

        def plain(messages: Sequence[Message]) -> None:
            for part in chunks(messages, BATCH):
                with raw.transaction(), raw.cursor() as cur:
                    ids = [m.id for m in part]
                    cur.execute(claim, ("plain", ids, plain_sql.hashes(m.body for m in part)))
                    claimed = {r[0] for r in cur.fetchall()}
                    cur.executemany(raw_insert, [row(m) for m in part if m.id in claimed])

        # The ceiling for a bulk handler that writes through a Session: the same multi-row
        # claim and the same executemany, by hand through a plain Session (no framework).
        factory = sessionmaker(self.engine, expire_on_commit=False)
        processed = f"{self.schema}.processed_events"

        def by_hand(messages: Sequence[Message]) -> None:
            for part in chunks(messages, BATCH):
                with factory() as session:
                    claimed = plain_sql.claim_by_hand(session, processed, part)
                    session.execute(insert, [row(m) for m in part if m.id in claimed])
                    session.commit()

        def checked(outcomes: list[Outcome]) -> None:
            if any(o is not Outcome.PROCESSED for o in outcomes):
                raise SystemExit(f"BENCH FAILED: not every message processed: {set(outcomes)}")

        def run_bulk(messages: Sequence[Message]) -> None:
            for part in chunks(messages, BATCH):
                checked(bulk.batch(part))

        def run_abulk(messages: Sequence[Message]) -> None:
            for part in chunks(messages, BATCH):
                checked(loop.run_until_complete(abulk.batch(part)))

        def run_batch(messages: Sequence[Message]) -> None:
            for part in chunks(messages, BATCH):
                checked(one.batch(part))

        return {
            "bulk handler, 500": run_bulk,
            "bulk handler, 500 (async)": run_abulk,
            "plain psycopg, claim + executemany, 500": plain,
            BY_HAND: by_hand,
            ".batch(500), per-message handler": run_batch,
        }

    def run(self) -> dict[str, Series]:
        configurations = self.configurations()
        counts = {name: self.args.messages for name in configurations}
        counts[".batch(500), per-message handler"] = self.args.batch_messages
        series = {name: Series(name) for name in configurations}
        for n, fn in enumerate(configurations.values()):  # warm up: pools, caches
            fn(make_messages(f"{self.tag}-w{n}", BATCH))
        for r in range(self.args.rounds):
            for n, (name, fn) in enumerate(configurations.items()):
                messages = make_messages(f"{self.tag}-r{r}-c{n}", counts[name])
                started = time.perf_counter()
                fn(messages)
                series[name].add(len(messages) / (time.perf_counter() - started))
        self.loop.run_until_complete(self.async_engine.dispose())
        self.loop.close()
        self.raw.close()
        return series

    # ---- two consumers over overlapping keys (item 6)

    def contended(self) -> list[Series]:
        """Two threads, bulk handlers of batch 20 over the same 20 accounts in opposite
        orders, each message updating its account and adding an outbox event keyed by it:
        in the library's lock order with the handler's updates sorted by key, and as
        before (each ``Outbox.add`` locking its key at once, updates in delivery order)."""
        accounts = [f"acct-{i:02d}" for i in range(20)]
        with self.engine.begin() as conn:
            conn.execute(
                text(f"INSERT INTO {self.accounts} VALUES (:id, 0) ON CONFLICT DO NOTHING"),
                [{"id": a} for a in accounts],
            )
        outbox = Outbox(self.tables)
        update = text(f"UPDATE {self.accounts} SET balance = balance + 1 WHERE id = :id")
        dedup = Deduplicator(self.engine, consumer="contended", tables=self.tables)

        @dedup.bulk_handler
        def in_order(messages: list[Message], session: Any) -> None:
            keys = sorted(m.json()["account"] for m in messages)  # our own writes by key
            session.execute(update, [{"id": k} for k in keys])
            for message in messages:
                outbox.add(session, "accounts", message.body, key=message.json()["account"])

        @dedup.bulk_handler
        def as_delivered(messages: list[Message], session: Any) -> None:
            before_commit.discard(session)  # the old Outbox.add: each key locked at once
            for message in messages:
                account = message.json()["account"]
                session.execute(update, {"id": account})
                outbox.add(session, "accounts", message.body, key=account)

        seen: list[int] = []
        event.listen(
            self.engine,
            "handle_error",
            lambda context: (
                seen.append(1)
                if getattr(context.original_exception, "sqlstate", None) == "40P01"
                else None
            ),
        )
        configurations = {
            "library's lock order, updates sorted by key": (in_order, self.args.contended_batches),
            "delivery order (before: Outbox.add locking at once)": (
                as_delivered,
                max(1, self.args.contended_batches // 5),  # each deadlock costs 1 s
            ),
        }
        out: list[Series] = []
        for name in configurations:
            out += [Series(f"{name}: rate"), Series(f"{name}: deadlocks", "per round", [], False)]
        for r in range(self.args.rounds):
            for n, (handle, batches) in enumerate(configurations.values()):
                del seen[:]
                started = time.perf_counter()
                self._two_consumers(handle, accounts, batches, f"{self.tag}-x{r}-{n}")
                out[2 * n].add(2 * batches * len(accounts) / (time.perf_counter() - started))
                out[2 * n + 1].add(len(seen))
        return out

    @staticmethod
    def _two_consumers(handle: Any, accounts: list[str], batches: int, tag: str) -> None:
        def consume(side: int) -> None:
            order = accounts if side == 0 else accounts[::-1]
            for b in range(batches):
                part = [
                    Message(id=f"{tag}-{side}-{b}-{a}", body=f'{{"account":"{a}"}}'.encode())
                    for a in order
                ]
                outcomes = handle.batch(part)
                if any(o is not Outcome.PROCESSED for o in outcomes):
                    raise SystemExit(f"BENCH FAILED: contended batch: {set(outcomes)}")

        threads = [threading.Thread(target=consume, args=(side,)) for side in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_round_arguments(parser)
    parser.add_argument("--messages", type=int, default=20_000, help="per bulk/plain round")
    parser.add_argument("--batch-messages", type=int, default=5_000, help="per .batch(500) round")
    parser.add_argument("--contended-batches", type=int, default=50, help="per consumer per round")
    args = parser.parse_args()
    check_rounds(parser, args)
    if args.quick:
        args.messages, args.batch_messages, args.contended_batches = 1_000, 500, 5
    url = os.environ.get("CONSUMERDEDUP_BENCH_PG_URL", DEFAULT_URL)
    bench = Bench(args, url)
    conditions = Conditions()
    conditions.postgres(bench.engine)
    conditions.add(
        "messages",
        f"{args.messages} per bulk/plain round, {args.batch_messages} per .batch(500) round, "
        f"{args.rounds} round(s) round-robin, 500 a transaction",
    )
    conditions.print()
    bench.setup()
    try:
        series = bench.run()
        contended = bench.contended()
    finally:
        bench.teardown()
    plain = series["plain psycopg, claim + executemany, 500"]
    print_table("Bulk handlers, PostgreSQL, msg/s", list(series.values()), plain, "vs plain")
    bulk, batch = series["bulk handler, 500"], series[".batch(500), per-message handler"]
    print_pairs(
        "Like with like: targets (ratio of medians, same run)",
        [
            (f"bulk / plain psycopg (target >= {PLAIN_TARGET}x)", bulk, plain),
            (f"bulk / .batch(500) (target >= {BATCH_TARGET}x)", bulk, batch),
            ("async bulk / blocking bulk", series["bulk handler, 500 (async)"], bulk),
        ],
    )
    hand = series[BY_HAND]
    print_pairs(
        "Ceiling: the same claim and executemany by hand through a plain Session",
        [
            ("that Session by hand / plain psycopg", hand, plain),
            ("bulk handler / that Session by hand", bulk, hand),
        ],
    )
    print_table("Two bulk consumers, batch 20, the same 20 keys in opposite orders", contended)
    conditions.print_after()


if __name__ == "__main__":
    main()
