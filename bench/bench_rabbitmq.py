"""Throughput of RabbitConsumerRunner (PostgreSQL) next to plain pika consume-and-ack loops.

Run it: ``.venv/bin/python bench/bench_rabbitmq.py`` (``--quick`` for a smoke run). It needs
RabbitMQ (``CONSUMERDEDUP_BENCH_AMQP_URL``, default the local guest account) and PostgreSQL
(``CONSUMERDEDUP_BENCH_PG_URL``, default the local ``test`` database). Its queues and its
schema are fresh and deleted at the end.

Scenarios, each draining the same number of fresh messages, published beforehand (untimed):

- the runner, one message per transaction (``batch_size=1``), and in batch mode
  (``batch_size=100``: one transaction and one ``multiple`` ack per batch), with a
  per-message handler (``@dedup.handler``: one INSERT through the Session per message) and
  with a bulk handler (``@dedup.bulk_handler``: one ``executemany`` INSERT per batch);
- like with like: plain pika and plain psycopg doing the same work by hand, into the same
  processed_events (another consumer name): per delivery (or per 100) one transaction that
  claims with ``INSERT ... ON CONFLICT DO NOTHING RETURNING`` and makes the business inserts
  (one ``execute`` each, or one ``executemany`` for the bulk handler's twin), then the ack
  (one ``multiple`` ack per 100);
- the same by-hand loop at 100 with a plain SQLAlchemy Session instead of psycopg (the same
  claim, then the handler's very ``session.execute`` per message, then the commit; no dedup
  pipeline, no guard): what a hand-written consumer that uses SQLAlchemy pays, so that the
  per-message handler's gap splits into SQLAlchemy's share and the framework's own;
- the ceiling: plain pika with no database, an ack per message and one per 100;
- for scale, no broker: the same handlers' ``process_batch`` on in-memory messages, and
  the hand-written transactions on in-memory (id, body) pairs.

Beside each rate, the client's CPU per message (``time.process_time`` of this process: the
runner and the hand-written loops run in it; the broker and PostgreSQL are other
processes), in all and inside the transactions (the runner's ``processor.process``, the
hand-written loop's transaction): what is left is what consuming costs (pika, and the
runner's own code: converting, batching, acking). CPU is what a loaded machine distorts
least, and so it splits the runner's own cost from the pipeline's.

Every scenario's clock starts before it opens its connection and stops when its last ack
is sent and its connection closed. Every message is really processed (fresh ids; the
business rows are counted) and every queue is empty afterwards. The scenarios run
round-robin ``--rounds`` times (at least 3); a figure is the median of the rounds' rates
with the slowest and fastest round, a ratio the ratio of two medians (``bench/measure.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pika
import psycopg
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from consumerdedup import DedupHandler, Deduplicator, Message, Outcome, Result, Tables, install
from consumerdedup.adapters.rabbitmq import RabbitConfig, RabbitConsumerRunner

sys.path.insert(0, os.path.dirname(__file__))
import plain_sql
from measure import Conditions, Series, add_round_arguments, check_rounds, print_pairs, print_table

AMQP_URL = os.environ.get("CONSUMERDEDUP_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
PG_URL = os.environ.get(
    "CONSUMERDEDUP_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
PREFETCH = 200
RUNNER_1 = "runner, batch_size=1"
BY_HAND_1 = "plain pika + psycopg, 1 a transaction"
RUNNER_100 = "runner, batch_size=100"
BY_HAND_100 = "plain pika + psycopg, 100 a transaction"
BY_SESSION_100 = "plain pika + SQLAlchemy Session, 100 a tx"
BULK_100 = "runner, bulk handler, batch_size=100"
BY_HAND_BULK_100 = "plain pika + psycopg, 100, executemany"
ALONE_100 = "pipeline alone, 100 a transaction"
ALONE_BULK_100 = "pipeline alone, bulk handler, 100"
PSYCOPG_100 = "plain psycopg alone, 100 a transaction"
PSYCOPG_BULK_100 = "plain psycopg alone, 100, executemany"


@dataclass
class Scenario:
    name: str
    drain: Callable[[str, int], None]  # (queue, count): consume exactly count messages
    broker: bool = True  # False: no broker (the transactions alone, on messages made in memory)
    database: bool = True  # False: nothing is written (business rows are not expected)
    rates: Series = field(default_factory=lambda: Series(""))
    cpu: Series = field(default_factory=lambda: Series("", "us/msg", higher_is_better=False))
    in_transactions: Series = field(
        default_factory=lambda: Series("", "us/msg", higher_is_better=False)
    )

    def __post_init__(self) -> None:
        self.rates.name = self.cpu.name = self.in_transactions.name = self.name


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tag = uuid.uuid4().hex[:8]
        self.schema = f"bench_rmq_{self.tag}"
        self.engine = create_engine(PG_URL)
        self.conninfo = make_url(PG_URL).set(drivername="postgresql").render_as_string(False)
        self.tables = Tables.define(f"{self.schema}.processed_events", f"{self.schema}.outbox")
        self.ledger = f"{self.schema}.payments"
        self.connection = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
        self.channel = self.connection.channel()
        self.queues: list[str] = []
        self.published = 0
        self.transactions_cpu = 0.0  # CPU seconds inside the transactions, this drain

    def counted(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, its CPU time added to ``transactions_cpu``."""

        def call(*args: Any, **kwargs: Any) -> Any:
            started = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.transactions_cpu += time.process_time() - started

        return call

    def setup(self) -> None:
        install(self.engine, self.tables)
        with self.engine.begin() as conn:
            conn.execute(text(f"CREATE TABLE {self.ledger} (amount int, message_id text)"))

    def teardown(self) -> None:
        for queue in self.queues:
            self.channel.queue_delete(queue)
            self.channel.queue_delete(queue + ".dlq")
        self.connection.close()
        with self.engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE'))
        self.engine.dispose()

    def queue(self) -> str:
        name = f"bench-{self.tag}-{len(self.queues)}"
        self.channel.queue_declare(name + ".dlq", durable=True)
        arguments = {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": name + ".dlq"}
        self.channel.queue_declare(name, durable=True, arguments=arguments)
        self.queues.append(name)
        return name

    def fill(self, queue: str, count: int) -> None:
        """Publish ``count`` fresh persistent messages, then wait until the queue holds them."""
        for mid, body in self.bodies(count):
            props = pika.BasicProperties(message_id=mid, delivery_mode=2)
            self.channel.basic_publish("", queue, body, props)
        while self.channel.queue_declare(queue, passive=True).method.message_count < count:
            self.connection.sleep(0.05)

    def bodies(self, count: int) -> list[tuple[str, bytes]]:
        """``count`` fresh (id, JSON body of ``--body-size`` bytes)."""
        pad = b"x" * max(0, self.args.body_size - 40)
        out = []
        for _ in range(count):
            self.published += 1
            out.append((f"{self.tag}-{self.published}", b'{"amount": 1, "pad": "' + pad + b'"}'))
        return out

    # ---- the scenarios

    def plain(self, ack_every: int) -> Callable[[str, int], None]:
        def drain(queue: str, count: int) -> None:
            connection = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
            channel = connection.channel()
            channel.basic_qos(prefetch_count=PREFETCH)
            seen = 0

            def on_message(ch: Any, method: Any, properties: Any, body: bytes) -> None:
                nonlocal seen
                seen += 1
                if seen % ack_every == 0 or seen == count:
                    ch.basic_ack(method.delivery_tag, multiple=ack_every > 1)
                if seen == count:
                    ch.stop_consuming()

            channel.basic_consume(queue, on_message)
            channel.start_consuming()
            connection.close()

        return drain

    def handler(self, consumer: str) -> DedupHandler:
        """The business insert, one row per message, under its own dedup consumer."""
        dedup = Deduplicator(self.engine, consumer=consumer, tables=self.tables)
        insert = text(f"INSERT INTO {self.ledger} (amount, message_id) VALUES (:n, :m)")

        @dedup.handler
        def apply(message: Message, session: Session) -> None:
            session.execute(insert, {"n": message.json()["amount"], "m": message.id})

        return apply

    def bulk_handler(self, consumer: str) -> DedupHandler:
        """The same business rows, one ``executemany`` per transaction."""
        dedup = Deduplicator(self.engine, consumer=consumer, tables=self.tables)
        insert = text(f"INSERT INTO {self.ledger} (amount, message_id) VALUES (:n, :m)")

        @dedup.bulk_handler
        def apply(messages: list[Message], session: Session) -> None:
            session.execute(insert, [{"n": m.json()["amount"], "m": m.id} for m in messages])

        return apply

    def pipeline(self, batch_size: int, bulk: bool = False) -> Callable[[str, int], None]:
        """For scale: the same handler and bodies through ``process_batch``, no broker."""
        name = f"alone-{batch_size}-{bulk}"
        apply = self.bulk_handler(name) if bulk else self.handler(name)
        process = self.counted(apply.process_batch)

        def drain(queue: str, count: int) -> None:
            messages = [Message(id=mid, body=body) for mid, body in self.bodies(count)]
            for start in range(0, count, batch_size):
                results = process(messages[start : start + batch_size])
                bad = [r for r in results if r.outcome is not Outcome.PROCESSED]
                if bad:
                    raise SystemExit(f"unexpected outcome: {bad[0].outcome} {bad[0].reason}")

        return drain

    def transaction(self, consumer: str, bulk: bool) -> Callable[..., None]:
        """The hand-written transaction over ``(id, body)`` pairs: one claim, then the business
        rows of the claimed ids with one ``execute`` each, or one ``executemany`` (``bulk``)."""
        claim = plain_sql.claim_many(self.tables.processed_events.fullname)
        insert = f"INSERT INTO {self.ledger} (amount, message_id) VALUES (%s, %s)"

        def commit(database: Any, pending: list[tuple[str, bytes]]) -> None:
            ids = [mid for mid, _ in pending]
            hashes = plain_sql.hashes(body for _, body in pending)
            with database.transaction(), database.cursor() as cur:
                cur.execute(claim, (consumer, ids, hashes))
                claimed = {row[0] for row in cur.fetchall()}
                rows = [(json.loads(b)["amount"], mid) for mid, b in pending if mid in claimed]
                if bulk:
                    cur.executemany(insert, rows)
                else:
                    for row in rows:
                        cur.execute(insert, row)

        return self.counted(commit)

    def session_transaction(self, consumer: str) -> Callable[..., None]:
        """``transaction`` through a plain SQLAlchemy Session (no dedup, no guard): the same
        claim, then the handler's very statement (``session.execute`` of the same ``text``)
        per claimed message, then the commit; what a hand-written SQLAlchemy consumer pays."""
        claim = text(
            plain_sql.claim_many(self.tables.processed_events.fullname)
            .replace("%s::varchar[]", "CAST(:ids AS varchar[])", 1)
            .replace("%s::varchar[]", "CAST(:hashes AS varchar[])", 1)
            .replace("%s", ":consumer", 1)
        )
        insert = text(f"INSERT INTO {self.ledger} (amount, message_id) VALUES (:n, :m)")

        def commit(sessions: Any, pending: list[tuple[str, bytes]]) -> None:
            ids = [mid for mid, _ in pending]
            hashes = plain_sql.hashes(body for _, body in pending)
            with sessions() as session:
                params = {"consumer": consumer, "ids": ids, "hashes": hashes}
                claimed = set(session.execute(claim, params).scalars())
                for mid, body in pending:
                    if mid in claimed:
                        session.execute(insert, {"n": json.loads(body)["amount"], "m": mid})
                session.commit()

        return self.counted(commit)

    def psycopg_alone(self, batch_size: int, bulk: bool = False) -> Callable[[str, int], None]:
        """For scale: the hand-written transactions on in-memory (id, body) pairs, no broker."""
        commit = self.transaction(f"psycopg-alone-{batch_size}-{bulk}", bulk)

        def drain(queue: str, count: int) -> None:
            pairs = self.bodies(count)
            with psycopg.connect(self.conninfo) as database:
                for start in range(0, count, batch_size):
                    commit(database, pairs[start : start + batch_size])

        return drain

    def by_hand(
        self, batch_size: int, bulk: bool = False, session: bool = False
    ) -> Callable[[str, int], None]:
        """Plain pika and plain psycopg doing what the runner does, written out by hand: the
        business rows with one ``execute`` each, or one ``executemany`` (``bulk``); with
        ``session``, through a plain SQLAlchemy Session instead of psycopg."""
        name = f"by-hand-{batch_size}-{bulk}-{session}"
        commit = self.session_transaction(name) if session else self.transaction(name, bulk)

        def drain(queue: str, count: int) -> None:
            database: Any = sessionmaker(self.engine) if session else psycopg.connect(self.conninfo)
            connection = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
            channel = connection.channel()
            channel.basic_qos(prefetch_count=PREFETCH)
            pending: list[tuple[str, bytes]] = []  # (message_id, body)
            seen = 0

            def commit_then_ack(ch: Any, last_tag: int) -> None:
                commit(database, pending)
                ch.basic_ack(last_tag, multiple=len(pending) > 1)
                pending.clear()

            def on_message(ch: Any, method: Any, properties: Any, body: bytes) -> None:
                nonlocal seen
                seen += 1
                pending.append((properties.message_id, body))
                if len(pending) == batch_size or seen == count:
                    commit_then_ack(ch, method.delivery_tag)
                if seen == count:
                    ch.stop_consuming()

            channel.basic_consume(queue, on_message)
            channel.start_consuming()
            connection.close()
            if not session:
                database.close()

        return drain

    def runner(self, batch_size: int, bulk: bool = False) -> Callable[[str, int], None]:
        name = f"bench-{batch_size}-{bulk}"
        apply = self.bulk_handler(name) if bulk else self.handler(name)
        config = RabbitConfig(prefetch=PREFETCH, batch_size=batch_size)

        def drain(queue: str, count: int) -> None:
            done = 0

            def tally(results: Sequence[Result]) -> None:
                nonlocal done
                bad = [r for r in results if r.outcome is not Outcome.PROCESSED]
                if bad:
                    raise SystemExit(f"unexpected outcome: {bad[0].outcome} {bad[0].reason}")
                done += len(results)
                if done >= count:
                    runner.stop()  # after this batch's acks

            runner = RabbitConsumerRunner(
                apply, queue, url=AMQP_URL, config=config, before_ack=tally
            )
            runner.processor.process = self.counted(runner.processor.process)
            runner.run()

        return drain

    def run(self) -> list[Scenario]:
        scenarios = [
            Scenario(RUNNER_1, self.runner(1)),
            Scenario(BY_HAND_1, self.by_hand(1)),
            Scenario(RUNNER_100, self.runner(100)),
            Scenario(BY_HAND_100, self.by_hand(100)),
            Scenario(BY_SESSION_100, self.by_hand(100, session=True)),
            Scenario(BULK_100, self.runner(100, bulk=True)),
            Scenario(BY_HAND_BULK_100, self.by_hand(100, bulk=True)),
            Scenario("plain pika, ack each, no database", self.plain(1), database=False),
            Scenario("plain pika, ack per 100, no database", self.plain(100), database=False),
            Scenario("pipeline alone, 1 a transaction", self.pipeline(1), broker=False),
            Scenario(ALONE_100, self.pipeline(100), broker=False),
            Scenario(ALONE_BULK_100, self.pipeline(100, bulk=True), broker=False),
            Scenario(PSYCOPG_100, self.psycopg_alone(100), broker=False),
            Scenario(PSYCOPG_BULK_100, self.psycopg_alone(100, bulk=True), broker=False),
        ]
        count = self.args.messages
        for round_ in range(-1, self.args.rounds):  # round -1: warm-up, not counted
            for scenario in scenarios:
                n = self.args.warmup if round_ < 0 else count
                queue = self.queue() if scenario.broker else ""
                if scenario.broker:
                    self.fill(queue, n)
                self.transactions_cpu = 0.0
                started, cpu = time.perf_counter(), time.process_time()
                scenario.drain(queue, n)
                elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
                if round_ >= 0:
                    scenario.rates.add(n / elapsed)
                    scenario.cpu.add(cpu / n * 1e6)
                    scenario.in_transactions.add(self.transactions_cpu / n * 1e6)
                    if self.args.verbose:
                        print(f"  round {round_ + 1}: {scenario.name}: {n / elapsed:,.0f} msg/s")
                left = (
                    queue and self.channel.queue_declare(queue, passive=True).method.message_count
                )
                if left:
                    raise SystemExit(f"{scenario.name}: {left} messages left in {queue}")
        with self.engine.connect() as conn:
            rows = conn.execute(text(f"SELECT count(*) FROM {self.ledger}")).scalar()
        writers = sum(s.database for s in scenarios)
        expected = writers * (self.args.warmup + count * self.args.rounds)
        if rows != expected:
            raise SystemExit(f"{rows} business rows, expected {expected}")
        return scenarios


def print_conditions(args: argparse.Namespace, bench: Bench) -> Conditions:
    conditions = Conditions()
    server = bench.connection._impl.server_properties  # what the broker announced
    conditions.add(
        "RabbitMQ",
        f"{server.get('version', '?')} on this machine at {without_password(AMQP_URL)}: durable "
        f"classic queues, persistent messages (written to disk), prefetch {PREFETCH}",
    )
    conditions.postgres(bench.engine)
    conditions.add("  drivers", f"pika {pika.__version__}")
    conditions.add(
        "messages",
        f"{args.messages} per scenario per round, {args.rounds} round(s) run round-robin, "
        f"after a warm-up round of {args.warmup}",
    )
    conditions.add("body", f"{args.body_size} bytes (JSON), the same in every scenario")
    conditions.print()
    return conditions


def without_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@")))


def print_results(scenarios: list[Scenario]) -> None:
    by_name = {s.name: s.rates for s in scenarios}
    print_table("RabbitMQ consumers", [s.rates for s in scenarios], by_name[BY_HAND_1], "vs hand")
    print_pairs(
        "Like with like (the runner / plain pika + plain psycopg doing the same work)",
        [
            ("one message a transaction", by_name[RUNNER_1], by_name[BY_HAND_1]),
            ("100 a transaction (target >= 0.8)", by_name[RUNNER_100], by_name[BY_HAND_100]),
            ("100, vs a plain SQLAlchemy Session", by_name[RUNNER_100], by_name[BY_SESSION_100]),
            ("a plain Session vs plain psycopg", by_name[BY_SESSION_100], by_name[BY_HAND_100]),
            ("100 a transaction, bulk handler", by_name[BULK_100], by_name[BY_HAND_BULK_100]),
        ],
    )
    print("Client CPU per message (this process; medians, us a message)")
    width = max(len(s.name) for s in scenarios)
    print(
        f"  {'configuration':<{width}}  {'in all':>8}  {'in the transactions':>19}  {'the rest':>8}"
    )
    for s in scenarios:
        whole, inside = s.cpu.median, s.in_transactions.median
        split = f"{inside:19.1f}  {whole - inside:8.1f}" if inside else f"{'-':>19}  {'-':>8}"
        print(f"  {s.name:<{width}}  {whole:8.1f}  {split}")
    print(
        "  (in the transactions: the runner's processor.process, the hand-written loop's "
        "transaction; the rest: pika, and the runner's own code)"
    )
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=3000, help="per scenario per round")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--body-size", type=int, default=256)
    parser.add_argument("-v", "--verbose", action="store_true", help="print every round")
    add_round_arguments(parser)
    args = parser.parse_args()
    check_rounds(parser, args)
    if args.quick:
        args.messages, args.warmup = 300, 50
    bench = Bench(args)
    conditions = print_conditions(args, bench)
    bench.setup()
    try:
        scenarios = bench.run()
    finally:
        bench.teardown()
    print_results(scenarios)
    conditions.print_after()


if __name__ == "__main__":
    main()
