"""consumerdedup.faststream's cost per message against the same FastStream handler without it.

Run: ``.venv/bin/python bench/bench_faststream.py`` (``--messages N``, ``--rounds N`` at
least 3; ``--quick``: a smoke run). Needs PostgreSQL (``CONSUMERDEDUP_BENCH_PG_URL``) and
RabbitMQ (``CONSUMERDEDUP_BENCH_AMQP_URL``); its schema and queues are fresh and removed at
the end.

The workload: FastStream's RabbitBroker, one subscriber, no prefetch set (FastStream's
default), a handler inserting one row through an AsyncSession (psycopg 3); N messages
published beforehand (untimed), each with its own message_id. Configurations, in one
process, round-robin, each round on its own fresh queue:

- plain: the handler opens its own transaction (``async with sessions.begin()``), as a
  FastStream user writes it without this library (nothing stops a redelivery applying
  twice);
- DedupMiddleware: the same insert on ``Context("session")``; the claim, the insert and
  the record commit together before the ack.

The figure is the consuming time from ``broker.start()`` to the N-th handler's end (the
N-th Result for the middleware), as messages a second; a figure is the median of the
rounds, a ratio the ratio of medians. Checks (a miss exits 1): N rows each round, and the
middleware's N records.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import pika
from faststream import Context
from faststream.rabbit import RabbitBroker, RabbitRouter
from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.measure import Conditions, Series, add_round_arguments, check_rounds, print_table
from consumerdedup import AsyncDeduplicator, Tables, install
from consumerdedup.faststream import SESSION, DedupMiddleware

PG = os.environ.get(
    "CONSUMERDEDUP_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
AMQP = os.environ.get("CONSUMERDEDUP_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")


def publish(queue: str, count: int) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(AMQP))
    try:
        channel = connection.channel()
        channel.queue_declare(queue, durable=True)
        channel.confirm_delivery()
        for i in range(count):
            properties = pika.BasicProperties(message_id=f"{queue}-{i}")
            channel.basic_publish("", queue, b'{"n": %d}' % i, properties)
    finally:
        connection.close()


def delete(queue: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(AMQP))
    try:
        connection.channel().queue_delete(queue)
    finally:
        connection.close()


async def consume(broker: RabbitBroker, done: Callable[[], bool]) -> float:
    """Seconds from start to ``done()``."""
    async with broker:
        started = time.perf_counter()
        await broker.start()
        while not done():
            await asyncio.sleep(0.005)
        return time.perf_counter() - started


async def plain_round(engine: Any, table: str, count: int) -> float:
    queue = f"bench-fs-{uuid.uuid4().hex[:10]}"
    publish(queue, count)
    sessions = async_sessionmaker(engine)
    handled = 0
    broker = RabbitBroker(AMQP, logger=None)

    @broker.subscriber(queue)
    async def insert(body: dict[str, int]) -> None:
        nonlocal handled
        async with sessions.begin() as session:
            await session.execute(text(f"INSERT INTO {table} (n) VALUES (:n)"), body)
        handled += 1

    try:
        return count / await consume(broker, lambda: handled == count)
    finally:
        delete(queue)


async def dedup_round(engine: Any, tables: Tables, table: str, count: int) -> float:
    queue = f"bench-fs-{uuid.uuid4().hex[:10]}"
    publish(queue, count)
    results: list[object] = []
    dedup = AsyncDeduplicator(engine, queue, tables=tables, observers=[results.append])
    once = DedupMiddleware(dedup)
    broker = RabbitBroker(AMQP, logger=None)
    router = RabbitRouter(middlewares=[once])

    @router.subscriber(queue)
    async def insert(
        body: dict[str, int], session: Annotated[AsyncSession, Context(SESSION)]
    ) -> None:
        await session.execute(text(f"INSERT INTO {table} (n) VALUES (:n)"), body)

    broker.include_router(router)
    try:
        await once.check(broker)
        return count / await consume(broker, lambda: len(results) == count)
    finally:
        delete(queue)


async def main(args: argparse.Namespace) -> int:
    schema = f"bench_fs_{uuid.uuid4().hex[:8]}"
    sync_engine = create_engine(PG)
    tables = Tables.define(f"{schema}.processed_events", f"{schema}.outbox")
    install(sync_engine, tables)
    table = f"{schema}.rows"
    with sync_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {table} (n INTEGER)"))
    engine = create_async_engine(PG, pool_size=10)
    conditions = Conditions()
    conditions.postgres(sync_engine)
    conditions.add("RabbitMQ", "127.0.0.1:5672, a durable classic queue, FastStream 0.7")
    conditions.add("workload", f"{args.messages:,} messages a round, one transaction each")
    conditions.print()
    plain, dedup = Series("plain FastStream handler"), Series("DedupMiddleware")
    failed = False
    try:
        for _ in range(args.rounds):
            for series, run in ((plain, plain_round), (dedup, None)):
                with sync_engine.begin() as conn:
                    conn.execute(text(f"TRUNCATE {table}"))
                if run is None:
                    series.add(await dedup_round(engine, tables, table, args.messages))
                else:
                    series.add(await run(engine, table, args.messages))
                with sync_engine.connect() as conn:
                    rows = conn.execute(text(f"SELECT count(*) FROM {table}")).scalar()
                if rows != args.messages:
                    print(f"BENCH FAILED: {series.name}: {rows} rows, expected {args.messages}")
                    failed = True
        print_table(f"FastStream RabbitMQ, {args.messages} messages", [plain, dedup], plain)
        per_message = (1 / dedup.median - 1 / plain.median) * 1e6
        print(f"cost of the middleware: {per_message:,.0f} us a message")
        conditions.print_after()
    finally:
        await engine.dispose()
        with sync_engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        sync_engine.dispose()
    return 1 if failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=2000)
    add_round_arguments(parser)
    parsed = parser.parse_args()
    check_rounds(parser, parsed)
    if parsed.quick:
        parsed.messages = 200
    sys.exit(asyncio.run(main(parsed)))
