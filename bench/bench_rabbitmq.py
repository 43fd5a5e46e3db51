"""Throughput of RabbitConsumerRunner (PostgreSQL) next to plain pika consume-and-ack loops.

Run it: ``.venv/bin/python bench/bench_rabbitmq.py`` (``--quick`` for a smoke run). It needs
RabbitMQ (``CONSUMERDEDUP_BENCH_AMQP_URL``, default the local guest account) and PostgreSQL
(``CONSUMERDEDUP_BENCH_PG_URL``, default the local ``test`` database). Its queues and its
schema are fresh and deleted at the end.

Scenarios, each draining the same number of fresh messages, published beforehand (untimed):

- plain pika, no database: ``basic_consume`` with a manual ack per message, and with one
  ``multiple`` ack per 100 messages: the ceiling the broker and client allow;
- the runner, one message per transaction (``batch_size=1``);
- the runner in batch mode (``batch_size=100``: one transaction and one ack per batch).

Every message is really processed (fresh ids; the business rows are counted). The scenarios
run round-robin in ``--rounds`` slices so drift of the machine falls on all alike; a rate is
a scenario's messages over its total time, ``spread`` the slowest and fastest slice.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pika
import sqlalchemy
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from consumerdedup import DedupHandler, Deduplicator, Message, Outcome, Result, Tables, install
from consumerdedup.adapters.rabbitmq import RabbitConfig, RabbitConsumerRunner

sys.path.insert(0, os.path.dirname(__file__))
from bench_pipeline import busy_text, cpu_busy, cpu_model, load_average

AMQP_URL = os.environ.get("CONSUMERDEDUP_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
PG_URL = os.environ.get(
    "CONSUMERDEDUP_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
PREFETCH = 200


@dataclass
class Scenario:
    name: str
    drain: Callable[[str, int], None]  # (queue, count): consume exactly count messages
    broker: bool = True  # False: the pipeline alone, on messages made in memory
    seconds: float = 0.0
    messages: int = 0
    slice_rates: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.messages / self.seconds if self.seconds else 0.0


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tag = uuid.uuid4().hex[:8]
        self.schema = f"bench_rmq_{self.tag}"
        self.engine = create_engine(PG_URL)
        self.tables = Tables.define(f"{self.schema}.processed_events", f"{self.schema}.outbox")
        self.ledger = f"{self.schema}.payments"
        self.connection = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
        self.channel = self.connection.channel()
        self.queues: list[str] = []
        self.published = 0

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

    def pipeline(self, batch_size: int) -> Callable[[str, int], None]:
        """For scale: the same handler and bodies through ``process_batch``, no broker."""
        apply = self.handler(f"alone-{batch_size}")

        def drain(queue: str, count: int) -> None:
            messages = [Message(id=mid, body=body) for mid, body in self.bodies(count)]
            for start in range(0, count, batch_size):
                results = apply.process_batch(messages[start : start + batch_size])
                bad = [r for r in results if r.outcome is not Outcome.PROCESSED]
                if bad:
                    raise SystemExit(f"unexpected outcome: {bad[0].outcome} {bad[0].reason}")

        return drain

    def runner(self, batch_size: int) -> Callable[[str, int], None]:
        apply = self.handler(f"bench-{batch_size}")
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
            runner.run()

        return drain

    def run(self) -> list[Scenario]:
        scenarios = [
            Scenario("plain pika, ack each, no database", self.plain(1)),
            Scenario("plain pika, ack per 100, no database", self.plain(100)),
            Scenario("runner, batch_size=1 (PostgreSQL)", self.runner(1)),
            Scenario("runner, batch_size=100 (PostgreSQL)", self.runner(100)),
            Scenario("ref: pipeline alone, 1 per transaction", self.pipeline(1), broker=False),
            Scenario("ref: pipeline alone, 100 per transaction", self.pipeline(100), broker=False),
        ]
        per_round = max(1, self.args.messages // self.args.rounds)
        for scenario in scenarios:  # warm-up: connections, statement caches
            queue = self.queue() if scenario.broker else ""
            if scenario.broker:
                self.fill(queue, self.args.warmup)
            scenario.drain(queue, self.args.warmup)
        for _ in range(self.args.rounds):
            for scenario in scenarios:
                queue = self.queue() if scenario.broker else ""
                if scenario.broker:
                    self.fill(queue, per_round)
                started = time.perf_counter()
                scenario.drain(queue, per_round)
                elapsed = time.perf_counter() - started
                scenario.seconds += elapsed
                scenario.messages += per_round
                scenario.slice_rates.append(per_round / elapsed)
                left = (
                    queue and self.channel.queue_declare(queue, passive=True).method.message_count
                )
                if left:
                    raise SystemExit(f"{scenario.name}: {left} messages left in {queue}")
        with self.engine.connect() as conn:
            rows = conn.execute(text(f"SELECT count(*) FROM {self.ledger}")).scalar()
        expected = 4 * (self.args.warmup + per_round * self.args.rounds)
        if rows != expected:
            raise SystemExit(f"{rows} business rows, expected {expected}")
        return scenarios


def print_conditions(args: argparse.Namespace, bench: Bench, busy: float | None) -> None:
    server = bench.connection._impl.server_properties  # what the broker announced
    with bench.engine.connect() as conn:
        pg_version = conn.exec_driver_sql("SHOW server_version").scalar()
        sync_commit = conn.exec_driver_sql("SHOW synchronous_commit").scalar()
    rows = [
        ("CPU", f"{os.cpu_count()} x {cpu_model()}"),
        ("load", f"{load_average()}; CPUs {busy_text(busy)} busy just before the run"),
        ("OS", platform.platform()),
        (
            "RabbitMQ",
            f"{server.get('version', '?')} at {without_password(AMQP_URL)}",
        ),
        (
            "PostgreSQL",
            f"{pg_version} (synchronous_commit={sync_commit}) at "
            f"{make_url(PG_URL).render_as_string(hide_password=True)}",
        ),
        (
            "Python",
            f"{platform.python_version()}; pika {pika.__version__}; "
            f"SQLAlchemy {sqlalchemy.__version__}",
        ),
        (
            "messages",
            f"{args.messages} per scenario in {args.rounds} round(s), "
            f"warm-up {args.warmup}; persistent, durable queues; prefetch {PREFETCH}",
        ),
        ("body", f"{args.body_size} bytes (JSON)"),
    ]
    width = max(len(k) for k, _ in rows)
    print("Conditions")
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    print()


def without_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@")))


def print_results(scenarios: list[Scenario]) -> None:
    base = scenarios[0].rate
    width = max(len(s.name) for s in scenarios)
    print(f"  {'scenario':<{width}}  {'msg/s':>8}  {'vs plain':>8}  spread (msg/s)")
    for s in scenarios:
        spread = f"{min(s.slice_rates):,.0f} .. {max(s.slice_rates):,.0f}"
        print(f"  {s.name:<{width}}  {s.rate:>8,.0f}  {s.rate / base:>8.2f}  {spread}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=6000, help="per scenario")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--body-size", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 600 messages, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.messages, args.rounds, args.warmup = 600, 1, 50
    busy = cpu_busy()
    bench = Bench(args)
    bench.setup()
    try:
        print_conditions(args, bench, busy)
        scenarios = bench.run()
    finally:
        bench.teardown()
    print_results(scenarios)


if __name__ == "__main__":
    main()
