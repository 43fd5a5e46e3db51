"""CPU per record of the Kafka runner with offsets in the database, beside the plain loop
(issue 36): where bench_kafka_offsets.py measures rates, this measures only the CPU time of
this process from the group's assignment to the last chunk's commit, which a loaded machine
distorts far less than a rate. Run it under py-spy to see where that time goes::

    .venv/bin/python bench/profile_kafka_offsets.py --scenario bulk --rounds 5
    .venv/bin/py-spy record -r 200 -f raw -o /tmp/offsets.txt -- \\
        .venv/bin/python bench/profile_kafka_offsets.py --scenario bulk --rounds 3

Scenarios: ``bulk`` / ``each`` (the runner, offsets in the database, ``claim_ids=False``,
AsyncDeduplicator), ``plain-bulk`` / ``plain-each`` (bench_kafka_offsets.py's plain loop),
``claims-bulk`` (with claims). A figure is the median of the rounds, in microseconds of CPU
per record; the join of the group is not counted. The runner freezes the collector once
set up (consumerdedup.collector); ``--no-freeze`` keeps it from doing so, for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
import bench_kafka
import bench_kafka_offsets as offsets
from bench_kafka import DEFAULT_PG
from tansu import start_tansu


class CpuBench(offsets.OffsetsBench):
    """OffsetsBench whose timed part also reads this process's CPU time."""

    cpu_start = 0.0

    async def joined(self, topic: str, group: str) -> Any:
        consumer = await super().joined(topic, group)
        self.cpu_start = time.process_time()
        return consumer


async def one_round(bench: CpuBench, scenario: str, count: int) -> float:
    topic = await bench.fill(count)
    if scenario.startswith("plain-"):
        await bench.plain_loop(topic, count, bulk=scenario == "plain-bulk")
        return (time.process_time() - bench.cpu_start) / count * 1e6
    bulk = scenario.endswith("bulk")
    claims = scenario.startswith("claims-")
    driver = scenario.startswith("driver-")
    task = asyncio.create_task(
        bench.offsets_runner(
            topic,
            count,
            bulk=bulk,
            offsets="database",
            claim_ids=claims,
            driver=driver,
            in_flight=bench.args.in_flight,
        )
    )
    # offsets_runner starts its clock once the group assigned the partitions: read the CPU
    # time at that moment too, by polling for the assignment the same way.
    start = time.process_time()
    while not task.done():
        runner = _RUNNERS[-1] if _RUNNERS else None
        if runner is not None and runner.consumer is not None and runner.consumer.assignment():
            start = time.process_time()
            break
        await asyncio.sleep(0.005)
    await task
    return (time.process_time() - start) / count * 1e6


_RUNNERS: list[Any] = []
"""The runners made, the last one running."""


class GcClock:
    """CPU time spent in the cyclic garbage collector, by generation (gc.callbacks)."""

    def __init__(self) -> None:
        self.spent = [0.0, 0.0, 0.0]
        self._started = 0.0
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.process_time()
        else:
            self.spent[info["generation"]] += time.process_time() - self._started

    def take(self) -> list[float]:
        spent, self.spent = self.spent, [0.0, 0.0, 0.0]
        return spent


async def main_async(args: argparse.Namespace) -> None:
    from consumerdedup.adapters.kafka import runner as runner_module

    class Tracked(runner_module.KafkaConsumerRunner):
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            _RUNNERS.append(self)

    bench_kafka.KafkaConsumerRunner = Tracked  # type: ignore[misc]  # Bench.runner makes them
    stack = contextlib.ExitStack()
    bootstrap, _ = start_tansu(stack)
    args.idempotent = False
    bench = CpuBench(
        args, bootstrap, args.url or os.environ.get("CONSUMERDEDUP_BENCH_PG_URL", DEFAULT_PG)
    )
    try:
        await bench.setup()
        from consumerdedup import collector

        if args.no_freeze:  # as before the runner froze the start-up objects itself
            collector._frozen = True
        else:  # now, not inside the first round (its full collection is start-up's)
            collector.freeze_once()
        figures = []
        clock = GcClock()
        for round_ in range(args.rounds):
            clock.take()
            figure = await one_round(bench, args.scenario, args.messages)
            figures.append(figure)
            in_gc = " + ".join(f"{t / args.messages * 1e6:.1f}" for t in clock.take())
            print(
                f"round {round_ + 1}: {figure:.1f} us CPU per record (gc by generation: {in_gc})",
                flush=True,
            )
        print(
            f"{args.scenario}: median {statistics.median(figures):.1f} us CPU per record "
            f"(min {min(figures):.1f}, max {max(figures):.1f}, {args.rounds} rounds of "
            f"{args.messages}); load {os.getloadavg()[0]:.1f}"
        )
    finally:
        await bench.teardown()
        await bench.engine.dispose()
        bench.blocking_engine.dispose()
        stack.close()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--scenario",
        choices=[
            "bulk",
            "each",
            "claims-bulk",
            "plain-bulk",
            "plain-each",
            "driver-bulk",
            "driver-each",
        ],
        default="bulk",
    )
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--in-flight", type=int, default=4, help="partitions_in_flight")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--body-size", type=int, default=256)
    parser.add_argument("--url")
    parser.add_argument(
        "--no-freeze",
        action="store_true",
        help="keep the runner from calling gc.freeze() once set up (collector.freeze_once)",
    )
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main_async(parse_args()))
