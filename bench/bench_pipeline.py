"""Throughput of the dedup pipeline on PostgreSQL, against the same inserts without dedup.

Run it: ``.venv/bin/python bench/bench_pipeline.py`` (or ``make bench``); ``--quick`` for a
smoke run. It needs a PostgreSQL server (``CONSUMERDEDUP_BENCH_PG_URL``, default the local
``test`` database). Everything it writes lives in a fresh schema, dropped at the end.

Scenarios, each on its own fresh message ids so every message is really processed:

- baseline: the business insert alone, a Session and a transaction per message;
- the pipeline one message at a time (check, handler, dedup record, commit), sync and async;
- ``.batch`` with 100 and 500 messages per call (one transaction per call), sync and async;
- for scale, plain psycopg doing the business insert plus a dedup-like row per transaction.

The scenarios run round-robin in ``--rounds`` slices, so slow drift of the machine or the
server (a checkpoint, autovacuum) falls on all of them alike; a rate is the scenario's total
messages over its total time, and ``spread`` is the slowest and fastest slice.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
import sqlalchemy
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

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
PER_MESSAGE_TARGET = 0.8  # per-message pipeline rate / baseline rate, at least
BATCH_TARGET = 10.0  # batch-of-500 rate / per-message pipeline rate, at least


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
                    kib = int(line.split()[1])
                    return f"{kib / 1024 / 1024:.1f} GiB"
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
    """The fraction of all CPUs busy over ``seconds``, while this process sleeps."""
    before = _cpu_times()
    time.sleep(seconds)
    after = _cpu_times()
    if before is None or after is None or after[1] == before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def busy_warning(busy: float | None) -> str | None:
    """A warning when other work competes for the CPUs: the figures would be understated."""
    if busy is None or busy < 0.15:
        return None
    return (
        f"WARNING: the CPUs were {busy:.0%} busy with other work just before the run; "
        "figures are noisy and understated."
    )


def server_settings(engine: Engine) -> dict[str, str]:
    names = ["server_version", "synchronous_commit", "fsync", "wal_sync_method", "shared_buffers"]
    with engine.connect() as conn:
        return {name: str(conn.exec_driver_sql(f"SHOW {name}").scalar()) for name in names}


def busy_text(busy: float | None) -> str:
    return "?" if busy is None else f"{busy:.0%}"


def print_conditions(
    args: argparse.Namespace, url: str, engine: Engine, busy: float | None
) -> None:
    pg = server_settings(engine)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    rows = [
        ("CPU", f"{os.cpu_count()} x {cpu_model()} ({usable} usable)"),
        ("memory", memory_total()),
        ("load", f"{load_average()}; CPUs {busy_text(busy)} busy just before the run"),
        ("OS", platform.platform()),
        ("PostgreSQL", pg["server_version"]),
        (
            "  settings",
            f"synchronous_commit={pg['synchronous_commit']} fsync={pg['fsync']} "
            f"wal_sync_method={pg['wal_sync_method']} shared_buffers={pg['shared_buffers']}",
        ),
        ("  server", make_url(url).render_as_string(hide_password=True)),
        ("Python", f"{platform.python_version()} ({platform.python_implementation()})"),
        ("SQLAlchemy", sqlalchemy.__version__),
        ("psycopg", f"{psycopg.__version__} (impl {psycopg.pq.__impl__}, libpq {libpq()})"),
        (
            "messages",
            f"{args.messages} per per-message scenario, {args.batch_messages} per batch "
            f"scenario, {args.rounds} round(s), warm-up {args.warmup}",
        ),
        ("body", f"{args.body_size} bytes"),
    ]
    width = max(len(k) for k, _ in rows)
    print("Conditions")
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    print()


def libpq() -> str:
    version = psycopg.pq.version()
    return f"{version // 10000}.{version % 100}"


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
    seconds: float = 0.0
    slice_rates: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return len(self.messages) / self.seconds if self.seconds else 0.0


class Bench:
    def __init__(self, args: argparse.Namespace, url: str) -> None:
        self.args = args
        self.url = url
        self.schema = f"bench_{uuid.uuid4().hex[:10]}"
        self.tag = uuid.uuid4().hex[:8]
        self.payments = f"{self.schema}.payments"
        self.raw_events = f"{self.schema}.raw_events"
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
            # Same shape and key as processed_events, for the plain-psycopg reference.
            conn.execute(
                text(
                    f"CREATE TABLE {self.raw_events} (consumer varchar(255), "
                    "message_id varchar(255), processed_at timestamptz NOT NULL, "
                    "payload_hash varchar(64) NOT NULL, outcome varchar(16) NOT NULL, "
                    "error text, PRIMARY KEY (consumer, message_id))"
                )
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

        # Reference: plain psycopg, no SQLAlchemy; business row + dedup-like row per transaction.
        conninfo = make_url(self.url).set(drivername="postgresql").render_as_string(False)
        raw_conn = self.raw_conn = psycopg.connect(conninfo)
        raw_business = (
            f"INSERT INTO {self.payments} (account, amount, message_id) VALUES (%s, %s, %s)"
        )
        raw_record = (
            f"INSERT INTO {self.raw_events} (consumer, message_id, processed_at, payload_hash, "
            "outcome, error) VALUES ('raw', %s, now(), %s, 'processed', NULL)"
        )
        fake_hash = "0" * 64

        def raw(messages: Sequence[Message]) -> None:
            for message in messages:
                with raw_conn.transaction(), raw_conn.cursor() as cur:
                    p = business_params(message)
                    cur.execute(raw_business, (p["account"], p["amount"], p["message_id"]))
                    cur.execute(raw_record, (message.id, fake_hash))

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
            (Scenario("ref: partitioned, per message", "sync", 1, one_by_one_by_day, True), per),
            (Scenario("ref: partitioned, .batch(100)", "sync", 100, batched_by_day, True), batch),
            (Scenario("ref: plain psycopg, 2 inserts", "sync", 1, raw, True), per),
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
                    scenario.seconds += elapsed
                    scenario.slice_rates.append(len(part) / elapsed)
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
    header = (
        f"{'scenario':<31} {'driver':<6} {'msgs':>7} {'seconds':>8} {'msg/s':>9} "
        f"{'ms/msg':>7} {'vs (a)':>7} {'vs own':>7}  {'spread msg/s':>15}"
    )
    print("Results (vs (a): rate / sync baseline; vs own: rate / baseline of the same driver)")
    print(header)
    print("-" * len(header))
    for s in scenarios:
        own = own_base[s.kind] if s.name != "ref: plain psycopg, 2 inserts" else base
        spread = f"{min(s.slice_rates):,.0f}-{max(s.slice_rates):,.0f}"
        print(
            f"{s.name:<31} {s.kind:<6} {len(s.messages):>7} {s.seconds:>8.2f} {s.rate:>9,.0f} "
            f"{1000 / s.rate:>7.3f} {s.rate / base.rate:>6.2f}x {s.rate / own.rate:>6.2f}x  "
            f"{spread:>15}"
        )
    print()

    def find(name: str, kind: str) -> Scenario:
        return next(s for s in scenarios if s.name.startswith(name) and s.kind == kind)

    checks = []
    for kind in ("sync", "async"):
        per = find("(b)", kind)
        ratio = per.rate / own_base[kind].rate
        checks.append(
            (
                f"per-message pipeline >= {PER_MESSAGE_TARGET} x baseline ({kind}, vs "
                f"{'(a)' if kind == 'sync' else 'async baseline'})",
                ratio,
                ratio >= PER_MESSAGE_TARGET,
            )
        )
    async_vs_a = find("(b)", "async").rate / base.rate
    checks.append(
        (
            f"per-message pipeline >= {PER_MESSAGE_TARGET} x (a) (async, vs sync (a))",
            async_vs_a,
            async_vs_a >= PER_MESSAGE_TARGET,
        )
    )
    for kind in ("sync", "async"):
        ratio = find("(c) pipeline .batch(500)", kind).rate / find("(b)", kind).rate
        checks.append(
            (
                f".batch(500) >= {BATCH_TARGET:g} x per-message pipeline ({kind})",
                ratio,
                ratio >= BATCH_TARGET,
            )
        )
    print("Targets")
    width = max(len(c[0]) for c in checks)
    for label, ratio, ok in checks:
        print(f"  {'PASS' if ok else 'MISS'}  {label:<{width}}  {ratio:6.2f}x")
    return all(ok for _, _, ok in checks)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, help="per per-message scenario (default 3000)")
    parser.add_argument("--batch-messages", type=int, help="per .batch scenario (default 30000)")
    parser.add_argument("--quick", action="store_true", help="a fast smoke run (300 / 3000)")
    parser.add_argument("--rounds", type=int, help="round-robin slices (default 5, quick 1)")
    parser.add_argument("--warmup", type=int, help="warm-up messages per scenario (default 200)")
    parser.add_argument("--body-size", type=int, default=256, help="message body bytes")
    parser.add_argument("--url", default=None, help="overrides CONSUMERDEDUP_BENCH_PG_URL")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every round")
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 when a target is missed (default: 0)"
    )
    args = parser.parse_args(argv)
    quick = args.quick
    if args.messages is None:
        args.messages = 300 if quick else 3000
    if args.batch_messages is None:
        args.batch_messages = 3000 if quick else 30000
    if args.rounds is None:
        args.rounds = 1 if quick else 5
    if args.warmup is None:
        args.warmup = 50 if quick else 200
    if args.messages < args.rounds or args.batch_messages < args.rounds or args.rounds < 1:
        parser.error("need at least one message per round in every scenario")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    url = args.url or os.environ.get("CONSUMERDEDUP_BENCH_PG_URL", DEFAULT_URL)
    bench = Bench(args, url)
    busy = cpu_busy()
    try:
        print_conditions(args, url, bench.engine, busy)
    except OperationalError as exc:
        shown = make_url(url).render_as_string(hide_password=True)
        print(f"cannot reach PostgreSQL at {shown}: {exc.orig}", file=sys.stderr)
        return 2
    warning = busy_warning(busy)
    if warning:
        print(warning, end="\n\n")
    try:
        bench.setup()
        scenarios = bench.run()
    finally:
        bench.teardown()
    ok = report(scenarios)
    print(f"\nLoad average after the run: {load_average()}")
    if warning:
        print(warning)
    return 1 if args.strict and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
