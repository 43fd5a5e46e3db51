"""Throughput of the dedup pipeline on PostgreSQL, against the same inserts without dedup.

Run it: ``.venv/bin/python bench/bench_pipeline.py`` (or ``make bench``); ``--quick`` for a
smoke run. It needs a PostgreSQL server (``CONSUMERDEDUP_BENCH_PG_URL``, default the local
``test`` database). Everything it writes lives in a fresh schema, dropped at the end.

Scenarios, each on its own fresh message ids so every message is really processed:

- baseline: the business insert alone, a Session and a transaction per message, and the
  same handler statement 500 to a transaction (one Session), sync and async;
- the pipeline one message at a time (check, handler, dedup record, commit), sync and async;
- ``.batch`` with 100 and 500 messages per call (one transaction per call), sync and async;
- like with like: plain psycopg (no SQLAlchemy) sending the same SQL to the same tables,
  per message and 500 per transaction, and 500 per transaction with ``executemany``.

The scenarios run round-robin in ``--rounds`` slices (default 5, at least 3), so slow drift
of the machine or the server (a checkpoint, autovacuum) falls on all of them alike; a rate is
the median of the slices' rates, ``spread`` the slowest and fastest slice, and a ratio is the
ratio of two medians (``bench/measure.py``).
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
from dataclasses import dataclass, field
from typing import Any

import psycopg
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import Session, sessionmaker

from consumerdedup import AsyncDeduplicator, Deduplicator, Message, Outcome, Tables, install

sys.path.insert(0, os.path.dirname(__file__))
import plain_sql
from measure import (
    MIN_ROUNDS,
    Conditions,
    Series,
    add_round_arguments,
    check_rounds,
    same_rounds,
)

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
PLAIN_PER_MESSAGE = "plain psycopg, same SQL"
PLAIN_BATCH = "plain psycopg, same SQL, 500"
PLAIN_MANY = "plain psycopg, 500, executemany"
BASELINE_500 = "(a) no dedup, 500 a transaction"
BY_HAND = "ceiling: Session, claim by hand"
BY_HAND_500 = "ceiling: Session, claim by hand, 500"
PLAIN_ALONE = "plain psycopg, business insert alone"
TARGETS = {  # issue 20: ratio of medians, at least
    "per message vs the same Session without dedup": 0.9,
    "per message vs plain psycopg, same SQL": 0.75,
    ".batch(500) vs the same handler in one transaction": 0.9,
    "async driver vs the blocking driver": 0.9,
}


# --------------------------------------------------------------------------- conditions


def print_conditions(args: argparse.Namespace, url: str, engine: Engine) -> Conditions:
    conditions = Conditions()
    conditions.postgres(engine)
    conditions.add("  server", make_url(url).render_as_string(hide_password=True))
    conditions.add(
        "messages",
        f"{args.messages} per per-message scenario, {args.batch_messages} per batch "
        f"scenario, split in {args.rounds} round(s) run round-robin, warm-up {args.warmup}",
    )
    conditions.add("body", f"{args.body_size} bytes (JSON), the same in every scenario")
    conditions.print()
    return conditions


# --------------------------------------------------------------------------- workload


def make_messages(tag: str, count: int, body_size: int) -> list[Message]:
    """Fresh ids under ``tag``; JSON bodies padded to ``body_size`` bytes, each distinct."""
    messages = []
    for i in range(count):
        head = f'{{"id":"{tag}-{i}","account":"acct-{i % 97}","amount":{i % 1000},"pad":"'
        body = head.encode()
        body += b"x" * max(0, body_size - len(body) - 2) + b'"}'
        messages.append(Message(id=f"{tag}-{i}", body=body))
    return messages


def business_params(message: Message) -> dict[str, Any]:
    """What the business insert writes; the same cheap derivation in every scenario."""
    return {"account": message.id[-2:], "amount": len(message.body), "message_id": message.id}


def chunks(items: Sequence[Message], size: int) -> list[Sequence[Message]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def slices(items: Sequence[Message], rounds: int) -> list[Sequence[Message]]:
    """``rounds`` contiguous slices, sizes differing by at most one."""
    step, extra = divmod(len(items), rounds)
    out, start = [], 0
    for r in range(rounds):
        end = start + step + (1 if r < extra else 0)
        out.append(items[start:end])
        start = end
    return out


@dataclass
class Scenario:
    name: str
    kind: str  # "sync" or "async"
    batch: int  # messages per call/transaction (1: one message per call)
    run: Callable[[Sequence[Message]], Any]  # returns outcomes, or None (no dedup)
    reference: bool = False  # shown for scale, not part of the targets
    messages: list[Message] = field(default_factory=list)
    rates: Series = field(default_factory=lambda: Series(""))

    @property
    def rate(self) -> float:
        """The median of the rounds' rates."""
        return self.rates.median


class Bench:
    def __init__(self, args: argparse.Namespace, url: str) -> None:
        self.args = args
        self.url = url
        self.schema = f"bench_{uuid.uuid4().hex[:10]}"
        self.tag = uuid.uuid4().hex[:8]
        self.payments = f"{self.schema}.payments"
        self.engine: Engine = create_engine(url)
        self.raw_conn: psycopg.Connection[Any] | None = None
        self.async_engine: AsyncEngine = create_async_engine(url)
        self.tables = Tables.define(f"{self.schema}.processed_events", f"{self.schema}.outbox")
        self.partitioned = Tables.define(
            f"{self.schema}.processed_by_day", f"{self.schema}.outbox_by_day", partitioned=True
        )
        self.insert_sql = text(
            f"INSERT INTO {self.payments} (account, amount, message_id) "
            "VALUES (:account, :amount, :message_id)"
        )

    # ---- setup / teardown

    def setup(self) -> None:
        install(self.engine, self.tables)
        install(self.engine, self.partitioned)  # today's partition, 7 days ahead, DEFAULT
        with self.engine.begin() as conn:
            conn.execute(
                text(f"CREATE TABLE {self.payments} (account text, amount int, message_id text)")
            )

    def teardown(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE'))
        self.engine.dispose()

    # ---- the scenarios' bodies

    def scenarios(self, loop: asyncio.AbstractEventLoop) -> list[Scenario]:
        insert_sql = self.insert_sql

        # (a) baseline: no dedup, Session per message, one transaction per message.
        factory = sessionmaker(self.engine, expire_on_commit=False)

        def baseline(messages: Sequence[Message]) -> None:
            for message in messages:
                with factory() as session:
                    session.execute(insert_sql, business_params(message))
                    session.commit()

        async_factory = async_sessionmaker(self.async_engine, expire_on_commit=False)

        async def abaseline(messages: Sequence[Message]) -> None:
            for message in messages:
                async with async_factory() as session:
                    await session.execute(insert_sql, business_params(message))
                    await session.commit()

        def baseline_batched(size: int) -> Callable[[Sequence[Message]], None]:
            def run(messages: Sequence[Message]) -> None:
                for part in chunks(messages, size):
                    with factory() as session:
                        for message in part:  # the handler's statement, once a message
                            session.execute(insert_sql, business_params(message))
                        session.commit()

            return run

        def abaseline_batched(size: int) -> Callable[[Sequence[Message]], Awaitable[None]]:
            async def run(messages: Sequence[Message]) -> None:
                for part in chunks(messages, size):
                    async with async_factory() as session:
                        for message in part:
                            await session.execute(insert_sql, business_params(message))
                        await session.commit()

            return run

        # (b), (c): the pipeline.
        dedup = Deduplicator(self.engine, consumer="bench", tables=self.tables)

        @dedup.handler
        def handle(message: Message, session: Session) -> None:
            session.execute(insert_sql, business_params(message))

        @dedup.handler(claim_first=False)
        def handle_check_first(message: Message, session: Session) -> None:
            session.execute(insert_sql, business_params(message))

        adedup = AsyncDeduplicator(self.async_engine, consumer="bench-async", tables=self.tables)

        @adedup.handler
        async def ahandle(message: Message, session: AsyncSession) -> None:
            await session.execute(insert_sql, business_params(message))

        by_day = Deduplicator(self.engine, consumer="bench", tables=self.partitioned)

        @by_day.handler
        def handle_by_day(message: Message, session: Session) -> None:
            session.execute(insert_sql, business_params(message))

        def one_by_one(messages: Sequence[Message]) -> list[Outcome]:
            return [handle(m) for m in messages]

        def one_by_one_by_day(messages: Sequence[Message]) -> list[Outcome]:
            return [handle_by_day(m) for m in messages]

        def batched_by_day(messages: Sequence[Message]) -> list[Outcome]:
            return [o for part in chunks(messages, 100) for o in handle_by_day.batch(part)]

        def one_by_one_check(messages: Sequence[Message]) -> list[Outcome]:
            return [handle_check_first(m) for m in messages]

        async def aone_by_one(messages: Sequence[Message]) -> list[Outcome]:
            return [await ahandle(m) for m in messages]

        def batched(size: int) -> Callable[[Sequence[Message]], list[Outcome]]:
            def run(messages: Sequence[Message]) -> list[Outcome]:
                return [o for part in chunks(messages, size) for o in handle.batch(part)]

            return run

        def abatched(size: int) -> Callable[[Sequence[Message]], Awaitable[list[Outcome]]]:
            async def run(messages: Sequence[Message]) -> list[Outcome]:
                return [o for part in chunks(messages, size) for o in await ahandle.batch(part)]

            return run

        # Like with like: plain psycopg (no SQLAlchemy) sending the SQL the pipeline sends,
        # into the same processed_events (another consumer name): claim with ON CONFLICT DO
        # NOTHING RETURNING, the business insert if the claim came back, COMMIT. The batch
        # version claims the whole batch in one statement, then runs the business inserts
        # one by one (as a per-message handler does) or with executemany (what a careful
        # hand-written consumer would do, and a per-message handler cannot).
        conninfo = make_url(self.url).set(drivername="postgresql").render_as_string(False)
        raw_conn = self.raw_conn = psycopg.connect(conninfo)
        processed = self.tables.processed_events.fullname
        raw_business = (
            f"INSERT INTO {self.payments} (account, amount, message_id) VALUES (%s, %s, %s)"
        )
        raw_claim = (
            f"INSERT INTO {processed} (consumer, message_id, processed_at, payload_hash, "
            "outcome, error) VALUES ('raw', %s, now(), %s, 'processed', NULL) "
            "ON CONFLICT (consumer, message_id) DO NOTHING RETURNING message_id"
        )
        raw_claim_many = plain_sql.claim_many(processed)

        def business_row(message: Message) -> tuple[Any, ...]:
            p = business_params(message)
            return (p["account"], p["amount"], p["message_id"])

        def raw(messages: Sequence[Message]) -> None:
            for message in messages:
                with raw_conn.transaction(), raw_conn.cursor() as cur:
                    cur.execute(raw_claim, (message.id, hashlib.sha256(message.body).hexdigest()))
                    if cur.fetchone() is not None:
                        cur.execute(raw_business, business_row(message))

        def raw_batched(size: int, many: bool) -> Callable[[Sequence[Message]], None]:
            def run(messages: Sequence[Message]) -> None:
                for part in chunks(messages, size):
                    with raw_conn.transaction(), raw_conn.cursor() as cur:
                        ids = [m.id for m in part]
                        hashes = plain_sql.hashes(m.body for m in part)
                        cur.execute(raw_claim_many, ("raw", ids, hashes))
                        claimed = {row[0] for row in cur.fetchall()}
                        rows = [business_row(m) for m in part if m.id in claimed]
                        if many:
                            cur.executemany(raw_business, rows)
                        else:  # one statement per message, as a per-message handler sends
                            for row in rows:
                                cur.execute(raw_business, row)

            return run

        # The ceilings: what any Session-based dedup reaches, written by hand with no
        # framework. The claim goes through the same Session (session.execute, as a team
        # would write it), then the handler's statement, then COMMIT; the batch version
        # claims the 500 in one multi-row statement. A pipeline around a Session handler
        # cannot beat these by more than the claim's SQLAlchemy cost: they price what the
        # targets against "the same handler without dedup" ask of a second write.
        hand_claim = text(
            f"INSERT INTO {processed} (consumer, message_id, processed_at, payload_hash, "
            "outcome, error) VALUES ('hand', :message_id, now(), :payload_hash, 'processed', "
            "NULL) ON CONFLICT (consumer, message_id) DO NOTHING RETURNING message_id"
        )

        def by_hand(messages: Sequence[Message]) -> None:
            for message in messages:
                with factory() as session:
                    digest = hashlib.sha256(message.body).hexdigest()
                    claimed = session.execute(
                        hand_claim, {"message_id": message.id, "payload_hash": digest}
                    ).first()
                    if claimed is not None:
                        session.execute(insert_sql, business_params(message))
                    session.commit()

        def by_hand_batched(size: int) -> Callable[[Sequence[Message]], None]:
            def run(messages: Sequence[Message]) -> None:
                for part in chunks(messages, size):
                    with factory() as session:
                        claimed = plain_sql.claim_by_hand(session, processed, part)
                        for message in part:
                            if message.id in claimed:
                                session.execute(insert_sql, business_params(message))
                        session.commit()

            return run

        def raw_alone(messages: Sequence[Message]) -> None:
            for message in messages:
                with raw_conn.transaction(), raw_conn.cursor() as cur:
                    cur.execute(raw_business, business_row(message))

        def in_loop(
            fn: Callable[[Sequence[Message]], Awaitable[Any]],
        ) -> Callable[[Sequence[Message]], Any]:
            # Time the whole coroutine inside one long-lived loop (no loop start-up per call).
            return lambda messages: loop.run_until_complete(fn(messages))

        per, batch = self.args.messages, self.args.batch_messages
        scenarios = [
            (Scenario("(a) baseline, no dedup", "sync", 1, baseline), per),
            (Scenario("(b) pipeline per message", "sync", 1, one_by_one), per),
            (Scenario("(b) pipeline per message", "async", 1, in_loop(aone_by_one)), per),
            (
                Scenario("ref: per message, check-first", "sync", 1, one_by_one_check, True),
                per,
            ),
            (Scenario("(c) pipeline .batch(100)", "sync", 100, batched(100)), batch),
            (Scenario("(c) pipeline .batch(100)", "async", 100, in_loop(abatched(100))), batch),
            (Scenario("(c) pipeline .batch(500)", "sync", 500, batched(500)), batch),
            (Scenario("(c) pipeline .batch(500)", "async", 500, in_loop(abatched(500))), batch),
            (Scenario("ref: baseline, no dedup", "async", 1, in_loop(abaseline), True), per),
            (Scenario(BASELINE_500, "sync", 500, baseline_batched(500), True), batch),
            (
                Scenario(BASELINE_500, "async", 500, in_loop(abaseline_batched(500)), True),
                batch,
            ),
            (Scenario("ref: partitioned, per message", "sync", 1, one_by_one_by_day, True), per),
            (Scenario("ref: partitioned, .batch(100)", "sync", 100, batched_by_day, True), batch),
            (Scenario(BY_HAND, "sync", 1, by_hand, True), per),
            (Scenario(BY_HAND_500, "sync", 500, by_hand_batched(500), True), batch),
            (Scenario(PLAIN_ALONE, "sync", 1, raw_alone, True), per),
            (Scenario(PLAIN_PER_MESSAGE, "sync", 1, raw, True), per),
            (Scenario(PLAIN_BATCH, "sync", 500, raw_batched(500, False), True), batch),
            (Scenario(PLAIN_MANY, "sync", 500, raw_batched(500, True), True), batch),
        ]
        out = []
        for n, (scenario, count) in enumerate(scenarios):
            scenario.messages = make_messages(f"{self.tag}-s{n}", count, self.args.body_size)
            out.append(scenario)
        return out

    # ---- running

    def warm_up(self, scenarios: list[Scenario]) -> None:
        if not self.args.warmup:
            return
        for n, scenario in enumerate(scenarios):
            count = max(self.args.warmup, scenario.batch)
            messages = make_messages(f"{self.tag}-w{n}", count, self.args.body_size)
            self.check(scenario, scenario.run(messages), messages)

    def check(self, scenario: Scenario, outcomes: Any, messages: Sequence[Message]) -> None:
        """Every message must really have been processed (not a duplicate, not failed)."""
        if outcomes is not None:
            bad = [o for o in outcomes if o is not Outcome.PROCESSED]
            if len(outcomes) != len(messages) or bad:
                raise SystemExit(
                    f"{scenario.name} [{scenario.kind}]: unexpected outcomes {bad[:5]}"
                )

    def verify_rows(self, scenarios: list[Scenario]) -> None:
        with self.engine.connect() as conn:
            for scenario in scenarios:
                prefix = scenario.messages[0].id.rsplit("-", 1)[0] + "-%"
                rows = conn.execute(
                    text(f"SELECT count(*) FROM {self.payments} WHERE message_id LIKE :p"),
                    {"p": prefix},
                ).scalar()
                if rows != len(scenario.messages):
                    raise SystemExit(
                        f"{scenario.name} [{scenario.kind}]: {rows} business rows, "
                        f"expected {len(scenario.messages)}"
                    )

    def run(self) -> list[Scenario]:
        loop = asyncio.new_event_loop()
        try:
            scenarios = self.scenarios(loop)
            self.warm_up(scenarios)
            parts = {id(s): slices(s.messages, self.args.rounds) for s in scenarios}
            for r in range(self.args.rounds):
                for scenario in scenarios:
                    part = parts[id(scenario)][r]
                    started = time.perf_counter()
                    outcomes = scenario.run(part)
                    elapsed = time.perf_counter() - started
                    self.check(scenario, outcomes, part)
                    scenario.rates.add(len(part) / elapsed)
                    if self.args.verbose:
                        print(
                            f"  round {r + 1}: {scenario.name} [{scenario.kind}] "
                            f"{len(part) / elapsed:,.0f} msg/s",
                            file=sys.stderr,
                        )
            self.verify_rows(scenarios)
            return scenarios
        finally:
            if self.raw_conn is not None:
                self.raw_conn.close()
            loop.run_until_complete(self.async_engine.dispose())
            loop.close()


# --------------------------------------------------------------------------- report


def report(scenarios: list[Scenario]) -> bool:
    base = scenarios[0]
    own_base = {
        "sync": base,
        "async": next(s for s in scenarios if s.reference and s.kind == "async"),
    }
    same_rounds(s.rates for s in scenarios)
    rounds = len(base.rates.values)
    what = f"median of {rounds} rounds" if rounds >= MIN_ROUNDS else "SMOKE RUN, not a measurement"
    print(
        f"Results ({what}; spread = slowest-fastest round; vs (a): median / median of the sync "
        "baseline; vs own: / the baseline of the same driver)"
    )
    header = (
        f"{'scenario':<37} {'driver':<6} {'msgs':>7} {'msg/s':>9} {'ms/msg':>7} "
        f"{'vs (a)':>7} {'vs own':>7}  {'spread msg/s':>15}"
    )
    print(header)
    print("-" * len(header))
    for s in scenarios:
        own = own_base[s.kind]
        print(
            f"{s.name:<37} {s.kind:<6} {len(s.messages):>7} {s.rate:>9,.0f} "
            f"{1000 / s.rate:>7.3f} {s.rate / base.rate:>6.2f}x {s.rate / own.rate:>6.2f}x  "
            f"{s.rates.spread:>15}"
        )
    print()

    def find(name: str, kind: str) -> Scenario:
        return next(s for s in scenarios if s.name.startswith(name) and s.kind == kind)

    def ratio(ours: Scenario, theirs: Scenario) -> tuple[str, float]:
        shown = f"{ours.rate:,.0f} / {theirs.rate:,.0f} msg/s"
        return shown, ours.rate / theirs.rate

    per_sync, per_async = find("(b)", "sync"), find("(b)", "async")
    b500_sync = find("(c) pipeline .batch(500)", "sync")
    b500_async = find("(c) pipeline .batch(500)", "async")
    rows = [
        ("per message vs the same Session without dedup", "sync", per_sync, base),
        (
            "per message vs plain psycopg, same SQL",
            "sync",
            per_sync,
            find(PLAIN_PER_MESSAGE, "sync"),
        ),
        (
            ".batch(500) vs the same handler in one transaction",
            "sync",
            b500_sync,
            find(BASELINE_500, "sync"),
        ),
        (
            ".batch(500) vs the same handler in one transaction",
            "async",
            b500_async,
            find(BASELINE_500, "async"),
        ),
        ("async driver vs the blocking driver", "per msg", per_async, per_sync),
        ("async driver vs the blocking driver", "500", b500_async, b500_sync),
    ]
    checks = []
    for label, kind, ours, theirs in rows:
        shown, value = ratio(ours, theirs)
        checks.append(
            (f"{label} ({kind}): {shown}", value, TARGETS[label], value >= TARGETS[label])
        )
    ceilings = limits(scenarios, find)
    print("Like with like (ratio of medians: the pipeline / plain psycopg sending the same SQL)")
    batch500 = find("(c) pipeline .batch(500)", "sync")
    pairs = [
        ("per message, one transaction each", find("(b)", "sync"), PLAIN_PER_MESSAGE),
        ("500 a transaction, same statements", batch500, PLAIN_BATCH),
        ("500 a transaction, vs executemany", batch500, PLAIN_MANY),
    ]
    for label, ours, plain in pairs:
        theirs = find(plain, "sync")
        print(
            f"  {label:<34} {ours.rate:>7,.0f} / {theirs.rate:>7,.0f} msg/s = "
            f"{ours.rate / theirs.rate:.2f}x"
        )
    print()
    print("Targets (issue 20; ratio of medians of the same run)")
    width = max(len(c[0]) for c in checks)
    for (label, value, target, ok), ceiling in zip(checks, ceilings, strict=True):
        beyond = (
            f"; the ceiling itself is {ceiling:.2f}x"
            if not ok and ceiling is not None and ceiling < target
            else ""
        )
        print(
            f"  {'PASS' if ok else 'MISS'}  {label:<{width}}  {value:5.2f}x  (>= {target:g}x"
            f"{beyond})"
        )
    return all(ok for *_, ok in checks)


def limits(scenarios: list[Scenario], find: Callable[[str, str], Scenario]) -> list[float | None]:
    """Print what any Session-based dedup reaches by hand in this run, and how close the
    pipeline comes to it; return each target row's ceiling (in the order of the targets)."""
    base, base_500 = find("(a) baseline", "sync"), find(BASELINE_500, "sync")
    hand, hand_500 = find(BY_HAND, "sync"), find(BY_HAND_500, "sync")
    plain, alone = find(PLAIN_PER_MESSAGE, "sync"), find(PLAIN_ALONE, "sync")
    ours, ours_500 = find("(b)", "sync"), find("(c) pipeline .batch(500)", "sync")
    async_base = find("ref: baseline, no dedup", "async")
    async_base_500 = find(BASELINE_500, "async")
    # A claim that cost nothing beyond its own SQL: the Session handler's transaction plus
    # what the claim adds to plain psycopg's (its statement and its WAL), per message.
    claim_cost = 1 / plain.rate - 1 / alone.rate
    free_claim = 1 / (1 / base.rate + claim_cost)
    lines = [
        (
            "a claim by hand through the Session / the same Session without dedup",
            hand.rate / base.rate,
        ),
        (
            "  the pipeline / that claim by hand (per message)",
            ours.rate / hand.rate,
        ),
        (
            "the Session without dedup / plain psycopg with the claim (per message)",
            base.rate / plain.rate,
        ),
        (
            "  + a claim costing only its SQL (plain psycopg's claim added) / plain psycopg",
            free_claim / plain.rate,
        ),
        (
            "a multi-row claim by hand through the Session, 500 / the same without dedup",
            hand_500.rate / base_500.rate,
        ),
        (
            "  the pipeline .batch(500) / that claim by hand",
            ours_500.rate / hand_500.rate,
        ),
        (
            "asyncio without dedup / blocking without dedup, per message",
            async_base.rate / base.rate,
        ),
        (
            "asyncio without dedup / blocking without dedup, 500",
            async_base_500.rate / base_500.rate,
        ),
    ]
    print("Ceilings: the same work by hand, no framework (ratio of medians, same run)")
    width = max(len(label) for label, _ in lines)
    for label, value in lines:
        print(f"  {label:<{width}}  {value:5.2f}x")
    print()
    return [
        hand.rate / base.rate,
        free_claim / plain.rate,
        hand_500.rate / base_500.rate,
        None,  # the async .batch(500) row: no async claim by hand is measured
        async_base.rate / base.rate,
        async_base_500.rate / base_500.rate,
    ]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, help="per per-message scenario (default 3000)")
    parser.add_argument("--batch-messages", type=int, help="per .batch scenario (default 30000)")
    add_round_arguments(parser, rounds=5)
    parser.add_argument("--warmup", type=int, help="warm-up messages per scenario (default 200)")
    parser.add_argument("--body-size", type=int, default=256, help="message body bytes")
    parser.add_argument("--url", default=None, help="overrides CONSUMERDEDUP_BENCH_PG_URL")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every round")
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 when a target is missed (default: 0)"
    )
    args = parser.parse_args(argv)
    check_rounds(parser, args)
    quick = args.quick
    if args.messages is None:
        args.messages = 300 if quick else 3000
    if args.batch_messages is None:
        args.batch_messages = 3000 if quick else 30000
    if args.warmup is None:
        args.warmup = 50 if quick else 200
    if args.messages < args.rounds or args.batch_messages < args.rounds or args.rounds < 1:
        parser.error("need at least one message per round in every scenario")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    url = args.url or os.environ.get("CONSUMERDEDUP_BENCH_PG_URL", DEFAULT_URL)
    bench = Bench(args, url)
    try:
        conditions = print_conditions(args, url, bench.engine)
    except OperationalError as exc:
        shown = make_url(url).render_as_string(hide_password=True)
        print(f"cannot reach PostgreSQL at {shown}: {exc.orig}", file=sys.stderr)
        return 2
    try:
        bench.setup()
        scenarios = bench.run()
    finally:
        bench.teardown()
    ok = report(scenarios)
    print()
    conditions.print_after()
    return 1 if args.strict and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
