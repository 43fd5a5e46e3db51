"""Kafka offsets in the database (``KafkaConfig(offsets="database")``) against today's runner
and a plain aiokafka + psycopg loop, same run, same broker (issue 36).

Run it: ``.venv/bin/python bench/bench_kafka_offsets.py`` (``--quick`` for a smoke run). The
broker and the database are found as bench_kafka.py finds them (Tansu on memory storage
unless ``CONSUMERDEDUP_BENCH_KAFKA_BOOTSTRAP``; PostgreSQL ``CONSUMERDEDUP_BENCH_PG_URL``).

Scenarios, each draining its own fresh topic (``--partitions`` partitions, filled
beforehand, untimed) as a fresh consumer group, ``batch_size`` 500, an AsyncDeduplicator on
async psycopg (this mode also with a blocking Deduplicator on psycopg, run in a worker
thread), ``partitions_in_flight`` 4 (the default), for a per-message handler (one INSERT a
record) and a bulk handler (one ``executemany`` a chunk):

- this mode, offsets only (``claim_ids=False``): each chunk's transaction holds the
  business rows, the FAILED records (none here) and the partition's next offset; no
  processed_events row per record;
- this mode, offsets only, its handler on the driver: the same, the handler sending the plain
  loop's statement through the transaction's psycopg connection
  (``consumerdedup.driver_connection``) instead of the SQLAlchemy session: like with like,
  the runner's own cost without SQLAlchemy's per statement;
- this mode with claims (``claim_ids=True``, the default of the mode): the same plus the
  multi-row claim of the records' ids (a producer's retried copy is answered DUPLICATE);
- today's runner (offsets in the broker, the claim in processed_events);
- the plain loop: aiokafka ``getmany(max_records=500)`` and async psycopg, one partition
  after another as a hand-written loop does, per partition chunk one transaction with the
  business rows (``executemany``, or one ``execute`` each for the per-message twin), then
  the offset commit. It is at least once: no claim, no offset in the database. This is the
  twin issue 36 sets the target against;
- the plain loop with the offset in the database: the same, plus the partition's next
  offset written in the chunk's transaction by one UPDATE conditional on an owner epoch,
  so it does the same database writes as this mode without claims (the fairer twin for
  the cost of the mode itself).

Every scenario, the plain loops included, runs after ``collector.freeze_once()`` (what a
runner does once set up: gc.freeze() of the start-up objects), called once the bench is set
up. The per-message handler decodes the JSON body for its row, as the plain loops do.

Timing starts when the group has the partitions and ends at the database commit of the last
chunk (the runner's ``before_ack``; the plain loop's commit), as in bench_kafka.py. Rounds
run round-robin; a figure is the median of the rounds' rates with the spread, a ratio the
ratio of two medians of the same run (``bench/measure.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Sequence

import aiokafka

from consumerdedup import collector

sys.path.insert(0, os.path.dirname(__file__))
import bench_kafka
from bench_kafka import Bench, Scenario, running
from measure import Series, print_pairs, print_table

DB_BULK = "offsets in the db, bulk handler"
DB_CLAIMS_BULK = "offsets in the db + claims, bulk handler"
TODAY_BULK = "today's runner, bulk handler"
PLAIN_BULK = "plain aiokafka + psycopg, executemany"
DB_BULK_BLOCKING = "offsets in the db, bulk handler, blocking"
DB_EACH = "offsets in the db, per-message handler"
DB_EACH_BLOCKING = "offsets in the db, per-message handler, blocking"
DB_CLAIMS_EACH = "offsets in the db + claims, per-message handler"
TODAY_EACH = "today's runner, per-message handler"
PLAIN_EACH = "plain aiokafka + psycopg, execute each"
PLAIN_DB_BULK = "plain loop + offset in the db, executemany"
PLAIN_DB_EACH = "plain loop + offset in the db, execute each"
DRIVER_BULK = "offsets in the db, bulk handler on the driver"
DRIVER_EACH = "offsets in the db, per-message handler on the driver"


class OffsetsBench(Bench):
    cpu: list[Series]
    """Per scenario, this process's CPU time per record, by round."""

    async def plain_loop(
        self, topic: str, count: int, *, bulk: bool, offset_in_db: bool = False
    ) -> float:
        """What a hand-written at-least-once consumer does: the rows, COMMIT, the offset
        (``offset_in_db``: the offset in the chunk's transaction too). bench_kafka's
        ``by_hand`` without the claim."""
        return await self.by_hand(topic, count, bulk=bulk, claim=False, offset_in_db=offset_in_db)

    async def offsets_runner(
        self,
        topic: str,
        count: int,
        *,
        bulk: bool,
        offsets: str,
        claim_ids: bool = True,
        blocking: bool = False,
        driver: bool = False,
        in_flight: int = 4,
    ) -> float:
        return await self.runner(
            topic,
            count,
            500,
            blocking,
            bulk=bulk,
            in_flight=in_flight,
            driver=driver,
            offsets=offsets,
            claim_ids=claim_ids,
        )


async def measure(args: argparse.Namespace, bench: OffsetsBench) -> list[Series]:
    def runner(
        bulk: bool, offsets: str, claim_ids: bool, blocking: bool = False, driver: bool = False
    ) -> Scenario:
        return lambda t, n: bench.offsets_runner(
            t, n, bulk=bulk, offsets=offsets, claim_ids=claim_ids, blocking=blocking, driver=driver
        )

    scenarios: list[tuple[str, Scenario]] = [
        (DB_BULK, runner(True, "database", False)),
        (DB_BULK_BLOCKING, runner(True, "database", False, blocking=True)),
        (DRIVER_BULK, runner(True, "database", False, driver=True)),
        (DB_CLAIMS_BULK, runner(True, "database", True)),
        (TODAY_BULK, runner(True, "broker", True)),
        (PLAIN_BULK, lambda t, n: bench.plain_loop(t, n, bulk=True)),
        (PLAIN_DB_BULK, lambda t, n: bench.plain_loop(t, n, bulk=True, offset_in_db=True)),
        (DB_EACH, runner(False, "database", False)),
        (DB_EACH_BLOCKING, runner(False, "database", False, blocking=True)),
        (DRIVER_EACH, runner(False, "database", False, driver=True)),
        (DB_CLAIMS_EACH, runner(False, "database", True)),
        (TODAY_EACH, runner(False, "broker", True)),
        (PLAIN_EACH, lambda t, n: bench.plain_loop(t, n, bulk=False)),
        (PLAIN_DB_EACH, lambda t, n: bench.plain_loop(t, n, bulk=False, offset_in_db=True)),
    ]
    if args.handlers != "both":  # the other half's scenarios are left out of the run
        bulk_names = {name for name, _ in scenarios[:7]}
        scenarios = [(n, s) for n, s in scenarios if (n in bulk_names) == (args.handlers == "bulk")]
    rates = {name: Series(name) for name, _ in scenarios}
    cpu = {name: Series(name, unit="us/rec", higher_is_better=False) for name, _ in scenarios}
    for round_ in range(args.rounds):
        for name, scenario in scenarios:
            topic = await bench.fill(args.messages)
            used = time.process_time()
            seconds = await scenario(topic, args.messages)
            # This process's CPU (consumer, driver, handler), the group's join included.
            cpu[name].add((time.process_time() - used) / args.messages * 1e6)
            rates[name].add(args.messages / seconds)
            if args.verbose:
                print(f"  round {round_ + 1}: {name}: {args.messages / seconds:,.0f} msg/s")
    await bench.check_rows(args.rounds * args.messages * len(scenarios))
    bench.cpu = list(cpu.values())
    return list(rates.values())


async def main_async(args: argparse.Namespace) -> None:
    async with running(args, OffsetsBench) as (bench, conditions):
        conditions.add("  drivers", f"aiokafka {aiokafka.__version__}, async psycopg")
        conditions.add(
            "records",
            f"{args.messages} per scenario per round, {args.rounds} round(s) run round-robin; "
            "batch_size 500, partitions_in_flight 4",
        )
        conditions.add(
            "topic", f"{args.partitions} partitions; value {args.body_size} bytes + event_id"
        )
        conditions.print()
        # What the first runner would do in this process anyway: all scenarios alike.
        collector.freeze_once()
        results = await measure(args, bench)
        by = {s.name: s for s in results}
        base = PLAIN_BULK if PLAIN_BULK in by else PLAIN_EACH
        print_table("Kafka offsets in the database", results, by[base], f"vs {base}")
        costs = {s.name: s for s in bench.cpu}
        print_table("CPU of this process per record", bench.cpu, costs[base], "plain/it")

        def pairs(rows: list[tuple[str, str, str]]) -> list[tuple[str, Series, Series]]:
            return [(label, by[it], by[twin]) for label, it, twin in rows if it in by]

        print_pairs(
            "Like with like (this mode / the plain loop, same run; target >= 0.9)",
            pairs(
                [
                    ("bulk, offsets only", DB_BULK, PLAIN_BULK),
                    ("bulk, offsets only, blocking", DB_BULK_BLOCKING, PLAIN_BULK),
                    ("bulk, offsets only, on the driver", DRIVER_BULK, PLAIN_BULK),
                    ("bulk, with claims", DB_CLAIMS_BULK, PLAIN_BULK),
                    ("bulk, today's runner", TODAY_BULK, PLAIN_BULK),
                    ("per-message, offsets only", DB_EACH, PLAIN_EACH),
                    ("per-message, offsets only, blocking", DB_EACH_BLOCKING, PLAIN_EACH),
                    ("per-message, offsets only, on the driver", DRIVER_EACH, PLAIN_EACH),
                    ("per-message, with claims", DB_CLAIMS_EACH, PLAIN_EACH),
                    ("per-message, today's runner", TODAY_EACH, PLAIN_EACH),
                ]
            ),
        )
        print_pairs(
            "The same database writes (this mode / the plain loop writing the offset too)",
            pairs(
                [
                    ("bulk, offsets only", DB_BULK, PLAIN_DB_BULK),
                    ("bulk, offsets only, blocking", DB_BULK_BLOCKING, PLAIN_DB_BULK),
                    ("bulk, offsets only, on the driver", DRIVER_BULK, PLAIN_DB_BULK),
                    ("per-message, offsets only", DB_EACH, PLAIN_DB_EACH),
                    ("per-message, offsets only, on the driver", DRIVER_EACH, PLAIN_DB_EACH),
                    ("per-message, offsets only, blocking", DB_EACH_BLOCKING, PLAIN_DB_EACH),
                ]
            ),
        )
        conditions.print_after()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    handlers = argparse.ArgumentParser(add_help=False)
    handlers.add_argument(
        "--handlers",
        choices=["both", "bulk", "each"],
        default="both",
        help="run only the bulk handler's scenarios, or only the per-message handler's",
    )
    known, rest = handlers.parse_known_args(argv)
    args = bench_kafka.parse_args(rest, description=__doc__.split("\n\n")[0], messages=10000)
    args.handlers = known.handlers
    return args


if __name__ == "__main__":
    asyncio.run(main_async(parse_args()))
