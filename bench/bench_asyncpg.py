"""What asyncpg's verification costs: AsyncDeduplicator on asyncpg beside psycopg async.

Run it: ``.venv/bin/python bench/bench_asyncpg.py``; ``--quick`` for a smoke run. It needs
a PostgreSQL server (``CONSUMERDEDUP_BENCH_PG_URL``, default the local ``test`` database);
everything it writes lives in a fresh schema, dropped at the end.

asyncpg cannot say whether its transaction was aborted, so the guard asks the server:
every COMMIT goes out as ``SAVEPOINT ...; COMMIT`` in one round trip, and a handler call
that met a database error is followed by one statement (never here: no handler fails).
The same handler (one INSERT into a ledger), in the same run, round-robin:

- AsyncDeduplicator on psycopg async and on asyncpg, per message, ``.batch(500)`` and a
  bulk handler of 500 (one executemany of the batch's rows);
- asyncpg with its COMMIT unverified (the plain ``COMMIT`` SQLAlchemy's adapter sends):
  what the SAVEPOINT costs, and nothing else (not a configuration anyone can choose);
- plain asyncpg (no SQLAlchemy, no guard) sending the same statements: BEGIN, the same
  claim (``INSERT ... ON CONFLICT DO NOTHING RETURNING``), the handler's INSERT, COMMIT;
  per message and 500 to a transaction.

A figure is the median of the rounds' rates, spread the slowest and fastest round, a ratio
the ratio of two medians of the same run (bench/measure.py).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence

import asyncpg
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine

from consumerdedup import AsyncDeduplicator, Message, Outcome, Tables, install
from consumerdedup.dedup import asyncpg_watch

sys.path.insert(0, os.path.dirname(__file__))
from measure import (
    Conditions,
    Series,
    add_round_arguments,
    check_rounds,
    print_pairs,
    print_table,
    timed,
)

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
BATCH = 500
Run = Callable[[Sequence[Message]], Awaitable[None]]


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=2000, help="per per-message scenario")
    parser.add_argument("--batch-messages", type=int, default=10_000, help="per batch scenario")
    add_round_arguments(parser, rounds=5)
    args = parser.parse_args()
    check_rounds(parser, args)
    if args.quick:
        args.messages, args.batch_messages = 40, BATCH * 2
    return args


def messages(tag: str, count: int) -> list[Message]:
    return [Message(id=f"{tag}-{i}", body=f'{{"n":{i}}}'.encode()) for i in range(count)]


def slices(items: Sequence[Message], rounds: int) -> list[Sequence[Message]]:
    size = len(items) // rounds
    return [items[i * size : (i + 1) * size] for i in range(rounds)]


class Bench:
    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.url = url
        self.args = args
        self.schema = f"bench_apg_{uuid.uuid4().hex[:8]}"
        self.engine = create_engine(url)
        self.tables = Tables.define(f"{self.schema}.processed_events", f"{self.schema}.outbox")
        self.ledger = f"{self.schema}.ledger"
        self.insert = text(f"INSERT INTO {self.ledger} (mid, n) VALUES (:m, :n)")

    def setup(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(text(f"CREATE SCHEMA {self.schema}"))
            conn.execute(text(f"CREATE TABLE {self.ledger} (mid TEXT, n INTEGER)"))
        install(self.engine, self.tables)

    def teardown(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {self.schema} CASCADE"))
        self.engine.dispose()

    def on(self, driver: str) -> AsyncEngine:
        url = make_url(self.url).set(drivername=f"postgresql+{driver}")
        return create_async_engine(url, pool_size=2, max_overflow=0)

    def pipeline(self, engine: AsyncEngine, consumer: str) -> tuple[Run, Run, Run]:
        """Per message, .batch(500) and a bulk handler of 500, all on ``engine``."""
        dedup = AsyncDeduplicator(engine, consumer, tables=self.tables)
        insert = self.insert

        @dedup.handler
        async def handle(message: Message, session: AsyncSession) -> None:
            await session.execute(insert, {"m": message.id, "n": len(message.body)})

        @dedup.bulk_handler
        async def handle_bulk(batch: list[Message], session: AsyncSession) -> None:
            await session.execute(insert, [{"m": m.id, "n": len(m.body)} for m in batch])

        async def per_message(part: Sequence[Message]) -> None:
            for message in part:
                expect([await handle(message)])

        async def batched(part: Sequence[Message]) -> None:
            for i in range(0, len(part), BATCH):
                expect(await handle.batch(part[i : i + BATCH]))

        async def bulk(part: Sequence[Message]) -> None:
            for i in range(0, len(part), BATCH):
                expect(await handle_bulk.batch(part[i : i + BATCH]))

        return per_message, batched, bulk

    def plain(self, connection: asyncpg.Connection) -> tuple[Run, Run]:
        """The same statements on asyncpg itself: per message, and 500 to a transaction."""
        claim = (
            f"INSERT INTO {self.schema}.processed_events (consumer, message_id, processed_at, "
            "payload_hash, outcome, error) SELECT 'plain', m, now(), h, 'processed', NULL "
            "FROM unnest($1::text[], $2::text[]) AS t(m, h) "
            "ON CONFLICT (consumer, message_id) DO NOTHING RETURNING message_id"
        )
        insert = f"INSERT INTO {self.ledger} (mid, n) VALUES ($1, $2)"

        async def one_transaction(part: Sequence[Message]) -> None:
            hashes = [hashlib.sha256(m.body).hexdigest() for m in part]
            async with connection.transaction():
                claimed = {
                    r[0] for r in await connection.fetch(claim, [m.id for m in part], hashes)
                }
                rows = [(m.id, len(m.body)) for m in part if m.id in claimed]
                if len(rows) == 1:
                    await connection.execute(insert, *rows[0])
                elif rows:
                    await connection.executemany(insert, rows)
            if len(claimed) != len(part):
                raise SystemExit("BENCH FAILED: plain asyncpg claimed fewer messages than sent")

        async def per_message(part: Sequence[Message]) -> None:
            for message in part:
                await one_transaction([message])

        async def batched(part: Sequence[Message]) -> None:
            for i in range(0, len(part), BATCH):
                await one_transaction(part[i : i + BATCH])

        return per_message, batched

    def paired(
        self, connection: asyncpg.Connection
    ) -> Callable[[Sequence[Message]], Awaitable[tuple[float, float]]]:
        """Plain asyncpg per message, its COMMIT alternately plain and verified (the same
        SAVEPOINT; COMMIT the guard sends), message by message: each variant's seconds a
        message, paired so that drift falls on both alike."""
        claim = (
            f"INSERT INTO {self.schema}.processed_events (consumer, message_id, processed_at, "
            "payload_hash, outcome, error) VALUES ('paired', $1, now(), $2, 'processed', NULL) "
            "ON CONFLICT (consumer, message_id) DO NOTHING RETURNING message_id"
        )
        insert = f"INSERT INTO {self.ledger} (mid, n) VALUES ($1, $2)"
        commits = ("COMMIT", asyncpg_watch._VERIFIED_COMMIT)

        async def run(part: Sequence[Message]) -> tuple[float, float]:
            spent = [0.0, 0.0]
            for i, message in enumerate(part):
                started = time.perf_counter()
                await connection.execute("BEGIN")
                digest = hashlib.sha256(message.body).hexdigest()
                if await connection.fetchval(claim, message.id, digest) is None:
                    raise SystemExit("BENCH FAILED: paired: a fresh id was not claimed")
                await connection.execute(insert, message.id, len(message.body))
                if await connection.execute(commits[i % 2]) != "COMMIT":
                    raise SystemExit("BENCH FAILED: paired: COMMIT not answered COMMIT")
                spent[i % 2] += timed(started)
            half = len(part) / 2
            return spent[0] / half, spent[1] / half

        return run

    def ledger_rows(self, tag: str) -> int:
        with self.engine.connect() as conn:
            sql = f"SELECT count(*) FROM {self.ledger} WHERE mid LIKE :tag"
            return int(conn.execute(text(sql), {"tag": f"{tag}-%"}).scalar_one())


def expect(outcomes: Sequence[Outcome]) -> None:
    if any(outcome is not Outcome.PROCESSED for outcome in outcomes):
        raise SystemExit(f"BENCH FAILED: not every message was PROCESSED: {set(outcomes)}")


class Unverified:
    """asyncpg's COMMIT as SQLAlchemy's adapter sends it, for one scenario: the SAVEPOINT's
    own cost (the module's constant swapped while the scenario runs, put back after)."""

    def __enter__(self) -> None:
        self.before = asyncpg_watch._VERIFIED_COMMIT
        asyncpg_watch._VERIFIED_COMMIT = "COMMIT"

    def __exit__(self, *_exc: object) -> None:
        asyncpg_watch._VERIFIED_COMMIT = self.before


async def main(args: argparse.Namespace, url: str, bench: Bench) -> None:
    psycopg_engine, asyncpg_engine = bench.on("psycopg"), bench.on("asyncpg")
    raw = await asyncpg.connect(make_url(url).set(drivername="postgresql").render_as_string(False))
    try:
        pg_one, pg_batch, pg_bulk = bench.pipeline(psycopg_engine, "bench-psycopg")
        apg_one, apg_batch, apg_bulk = bench.pipeline(asyncpg_engine, "bench-asyncpg")
        bare_one, _, _ = bench.pipeline(asyncpg_engine, "bench-asyncpg-unverified")
        plain_one, plain_batch = bench.plain(raw)
        paired = bench.paired(raw)
        plain_commit = Series("plain asyncpg, COMMIT", unit="us/msg", higher_is_better=False)
        verified_commit = Series(
            "plain asyncpg, SAVEPOINT; COMMIT", unit="us/msg", higher_is_better=False
        )
        pairs = slices(messages("pair", args.messages), args.rounds)

        series: dict[str, Series] = {}
        per_message: list[tuple[str, Run, bool]] = [
            ("psycopg async, per message", pg_one, False),
            ("asyncpg, per message", apg_one, False),
            ("asyncpg, COMMIT unverified, per message", bare_one, True),
            ("plain asyncpg, same SQL, per message", plain_one, False),
        ]
        batches: list[tuple[str, Run, bool]] = [
            ("psycopg async, .batch(500)", pg_batch, False),
            ("asyncpg, .batch(500)", apg_batch, False),
            ("psycopg async, bulk 500", pg_bulk, False),
            ("asyncpg, bulk 500", apg_bulk, False),
            ("plain asyncpg, same SQL, 500", plain_batch, False),
        ]
        work: list[tuple[str, Run, bool, list[Sequence[Message]]]] = []
        for n, (name, run, bare) in enumerate(per_message):
            work.append((name, run, bare, slices(messages(f"p{n}", args.messages), args.rounds)))
        for n, (name, run, bare) in enumerate(batches):
            parts = slices(messages(f"b{n}", args.batch_messages), args.rounds)
            work.append((name, run, bare, parts))
        for name, run, _bare, _parts in work:  # warm-up: connections, prepared statements
            series[name] = Series(name)
            await run(messages(f"warm-{uuid.uuid4().hex[:6]}", 4))
        for round_ in range(args.rounds):
            for name, run, bare, parts in work:
                part = parts[round_]
                started = time.perf_counter()
                if bare:
                    with Unverified():
                        await run(part)
                else:
                    await run(part)
                series[name].add(len(part) / timed(started))
            bare_s, verified_s = await paired(pairs[round_])
            plain_commit.add(bare_s * 1e6)
            verified_commit.add(verified_s * 1e6)
        for n, (name, *_rest) in enumerate(per_message):
            if bench.ledger_rows(f"p{n}") != args.messages // args.rounds * args.rounds:
                raise SystemExit(f"BENCH FAILED: {name}: ledger rows != messages")
        for n, (name, *_rest) in enumerate(batches):
            if bench.ledger_rows(f"b{n}") != args.batch_messages // args.rounds * args.rounds:
                raise SystemExit(f"BENCH FAILED: {name}: ledger rows != messages")

        s = series
        print_table("Per message", [s[name] for name, _, _ in per_message])
        print_table("500 a transaction", [s[name] for name, _, _ in batches])
        print_pairs(
            "asyncpg / psycopg async (ratio of medians, same run, same handler)",
            [
                ("per message", s["asyncpg, per message"], s["psycopg async, per message"]),
                (".batch(500)", s["asyncpg, .batch(500)"], s["psycopg async, .batch(500)"]),
                ("bulk 500", s["asyncpg, bulk 500"], s["psycopg async, bulk 500"]),
            ],
        )
        print_pairs(
            "Like with like: asyncpg through consumerdedup / plain asyncpg, same statements",
            [
                (
                    "per message",
                    s["asyncpg, per message"],
                    s["plain asyncpg, same SQL, per message"],
                ),
                ("bulk 500", s["asyncpg, bulk 500"], s["plain asyncpg, same SQL, 500"]),
            ],
        )
        verified, bare = s["asyncpg, per message"], s["asyncpg, COMMIT unverified, per message"]
        print_pairs(
            "The verification's own cost (the SAVEPOINT sent with COMMIT)",
            [
                ("verified / unverified, per message", verified, bare),
            ],
        )
        if verified.median and bare.median:
            cost = (1 / verified.median - 1 / bare.median) * 1e6
            print(f"  about {cost:,.0f} us a message (difference of the medians' inverses)\n")
        print_table(
            "The SAVEPOINT alone, paired message by message on plain asyncpg (seconds a "
            "message; the two variants alternate)",
            [verified_commit],
            baseline=plain_commit,
            baseline_label="vs COMMIT",
        )
        print(
            f"  plain COMMIT: {plain_commit.median:,.0f} us a message (spread "
            f"{plain_commit.spread}); the SAVEPOINT adds "
            f"{verified_commit.median - plain_commit.median:,.0f} us (difference of medians)\n"
        )
    finally:
        await raw.close()
        await psycopg_engine.dispose()
        await asyncpg_engine.dispose()


def run() -> None:
    args = arguments()
    url = os.environ.get("CONSUMERDEDUP_BENCH_PG_URL", DEFAULT_URL)
    bench = Bench(url, args)
    conditions = Conditions()
    conditions.postgres(bench.engine)
    conditions.add("  server", make_url(url).render_as_string(hide_password=True))
    conditions.add("asyncpg", asyncpg.__version__)
    conditions.add(
        "messages",
        f"{args.messages} per per-message scenario, {args.batch_messages} per batch scenario "
        f"({BATCH} a transaction), in {args.rounds} round(s) run round-robin; one event loop, "
        "one connection at a time; handler: one INSERT",
    )
    conditions.print()
    bench.setup()
    try:
        asyncio.run(main(args, url, bench))
    finally:
        bench.teardown()
    conditions.print_after()


if __name__ == "__main__":
    run()
