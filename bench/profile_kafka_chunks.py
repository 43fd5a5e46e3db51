"""CPU per record of the Kafka runner's chunk path alone, offsets in the database (issue 36):
no broker, so none of a fetch's variance (how many records each fetch brings decides how
many chunks, and profile_kafka_offsets.py's rounds spread by half of their figure for it).

Records are made in memory as aiokafka's fetcher makes them (``ConsumerRecord``, the value,
the ``event_id`` header and about the CreateTimes of bench_kafka.py's ``fill``),
``--partitions`` partitions of ``--messages`` records in all; each partition's chunks of
``batch_size`` go, in offset order, through the runner's own ``_process`` (``to_message`` per
record, then the handler's pipeline with the partition's ``OffsetFence``, taken by
``OffsetStore.take`` as on assignment), the partitions side by side as
``partitions_in_flight`` 4 has them. The handler is
bench_kafka.py's bulk (``--scenario bulk``) or per-message (``each``) one on async psycopg,
offsets only (``claim_ids=False``). A figure is the process CPU from the first chunk to the
last commit, per record; the median of ``--rounds`` rounds, each on fresh partitions::

    .venv/bin/python bench/profile_kafka_chunks.py --scenario bulk --rounds 7

CPU time on a shared machine still spreads by a third between rounds; for a change of a few
per cent, count instructions instead (deterministic, load-blind): the marginal instructions
per record between two sizes, each under callgrind, which cancels the start-up's::

    valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.%p .venv/bin/python \\
        bench/profile_kafka_chunks.py --rounds 1 --messages 4000    # then 12000
    # (Ir at 12000 - Ir at 4000) / 8000 = instructions per record
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from typing import Any

import psycopg
from aiokafka.structs import ConsumerRecord  # type: ignore[import-untyped]
from sqlalchemy import text

sys.path.insert(0, os.path.dirname(__file__))
from bench_kafka import DEFAULT_PG, Bench

from consumerdedup import collector
from consumerdedup.adapters.kafka import KafkaConfig, KafkaConsumerRunner
from consumerdedup.adapters.kafka.offsets import OffsetStore


def records(bench: Bench, topic: str, partition: int, count: int) -> list[Any]:
    """``count`` records of one partition, as the fetcher hands them over."""
    made = []
    now = int(time.time() * 1000)
    for offset in range(count):
        # The producer's CreateTime: bench_kafka.py's fill gives about 16 records of a
        # partition the same millisecond (9395 of 10000 consecutive ones, measured).
        created = now + offset // 16
        key = f"{topic}-{partition}-{offset}"
        value = bench.value(key, offset)
        headers = [("event_id", key.encode())]
        made.append(
            ConsumerRecord(
                topic, partition, offset, created, 0, None, value, None, len(value), -1, headers
            )
        )
    return made


async def plain_round(bench: Bench, args: argparse.Namespace, bulk: bool) -> float:
    """The plain loop's chunk path on the same records: per chunk one transaction on async
    psycopg with the rows (``executemany``, or one ``execute`` each) and the partition's next
    offset by one UPDATE conditional on its owner epoch (bench_kafka.py ``by_hand`` with
    ``offset_in_db``, without the broker); the partitions side by side on four connections,
    as the runner's four in flight."""
    topic = f"plain-{uuid.uuid4().hex[:10]}"
    schema, group = bench.schema, "plain-chunks"
    insert = f"INSERT INTO {schema}.ledger VALUES (%s, %s)"
    advance = (
        f"UPDATE {schema}.plain_offsets SET next_offset = %s, updated_at = now() "
        "WHERE consumer_group = %s AND topic = %s AND partition = %s AND owner_epoch = %s"
    )
    per = args.messages // args.partitions
    fetched = {p: records(bench, topic, p, per) for p in range(args.partitions)}
    connections = [
        await psycopg.AsyncConnection.connect(bench.conninfo) for _ in range(args.partitions)
    ]
    async with connections[0].transaction(), connections[0].cursor() as cur:
        await cur.executemany(
            f"INSERT INTO {schema}.plain_offsets VALUES (%s, %s, %s, NULL, 1, now())",
            [(group, topic, p) for p in fetched],
        )

    async def partition(p: int) -> None:
        database = connections[p]
        for start in range(0, per, 500):
            chunk = fetched[p][start : start + 500]
            async with database.transaction(), database.cursor() as cur:
                ids = [dict(r.headers)["event_id"].decode() for r in chunk]
                rows = [(i, json.loads(r.value)["amount"]) for i, r in zip(ids, chunk, strict=True)]
                if bulk:
                    await cur.executemany(insert, rows)
                else:
                    for row in rows:
                        await cur.execute(insert, row)
                await cur.execute(advance, (chunk[-1].offset + 1, group, topic, p, 1))
                assert cur.rowcount == 1, "fenced"

    try:
        used = time.process_time()
        await asyncio.gather(*(partition(p) for p in fetched))
        return (time.process_time() - used) / (per * args.partitions) * 1e6
    finally:
        for connection in connections:
            await connection.close()


async def one_round(bench: Bench, args: argparse.Namespace, bulk: bool) -> float:
    if args.scenario.startswith("plain-"):
        return await plain_round(bench, args, bulk)
    topic = f"chunks-{uuid.uuid4().hex[:10]}"
    config = KafkaConfig(batch_size=500, offsets="database", claim_ids=False)
    driver = args.scenario.startswith("driver-")
    runner = KafkaConsumerRunner(
        bench.handler(False, bulk, driver), topic, bootstrap_servers="unused:9092", config=config
    )
    store = OffsetStore(bench.engine, bench.tables, "chunks-" + topic)
    per = args.messages // args.partitions
    fetched = {p: records(bench, topic, p, per) for p in range(args.partitions)}
    owned = await store.take([(topic, p) for p in fetched])

    async def partition(p: int) -> None:
        mine = owned[topic, p]
        for start in range(0, per, config.batch_size):
            chunk = fetched[p][start : start + config.batch_size]
            fence = store.fence(topic, p, mine, claims=False, first=chunk[0].offset)
            results = await runner._process(chunk, fence)
            assert not fence.fenced and len(results) == len(chunk)
            store.committed(mine, fence)

    used = time.process_time()
    await asyncio.gather(*(partition(p) for p in fetched))
    return (time.process_time() - used) / (per * args.partitions) * 1e6


async def main_async(args: argparse.Namespace) -> None:
    args.idempotent = False
    url = args.url or os.environ.get("CONSUMERDEDUP_BENCH_PG_URL", DEFAULT_PG)
    bench = Bench(args, "unused:9092", url)
    try:
        await bench.setup()
        collector.freeze_once()  # as the runner does once set up
        figures = []
        for round_ in range(args.rounds):
            figure = await one_round(bench, args, args.scenario.endswith("bulk"))
            figures.append(figure)
            print(f"round {round_ + 1}: {figure:.1f} us CPU per record", flush=True)
        print(
            f"chunks {args.scenario}: median {statistics.median(figures):.2f} us CPU per record "
            f"(min {min(figures):.2f}, max {max(figures):.2f}, {args.rounds} rounds of "
            f"{args.messages}); load {os.getloadavg()[0]:.1f}"
        )
    finally:  # the schema only: no broker, no topic to delete
        async with bench.engine.begin() as conn:
            await conn.execute(text(f"DROP SCHEMA IF EXISTS {bench.schema} CASCADE"))
        await bench.engine.dispose()
        bench.blocking_engine.dispose()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--scenario",
        choices=["bulk", "each", "driver-bulk", "driver-each", "plain-bulk", "plain-each"],
        default="bulk",
        help="the runner with bench_kafka's handler through the session, or on the driver "
        "connection (driver-), or the plain loop (plain-)",
    )
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--body-size", type=int, default=256)
    parser.add_argument("--url")
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main_async(parse_args()))
