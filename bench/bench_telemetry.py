"""What telemetry costs per message on the runners' path (``BlockingProcessor.process``).

Run it: ``.venv/bin/python bench/bench_telemetry.py [--messages N] [--rounds R] [--quick]``.
One message per batch (a runner's worst case: every hook runs per message), twice: on
SQLite in memory, where the pipeline itself is as cheap as it gets and the hook's share
shows; and on PostgreSQL, one transaction per message, which is what a consumer pays.
Modes, round-robin, each on fresh ids:

- ``direct``: the processor's inner call, as the code was before the hooks;
- ``off``: ``process()`` with no telemetry (the hook slot read, found empty);
- ``noop``: ``telemetry.instrument()`` with OpenTelemetry's default (no-op) providers;
- ``sdk``: ``instrument()`` with the SDK, a SimpleSpanProcessor into memory and an
  in-memory metric reader (every span built, exported, every metric recorded).

A figure is the median of the rounds' messages per second; ratios are to ``direct``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from collections.abc import Callable

from measure import Conditions, Series, add_round_arguments, check_rounds, print_pairs, print_table
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.pool import StaticPool

from consumerdedup import Deduplicator, Message, Tables, install, telemetry
from consumerdedup.dedup.processing import BlockingProcessor

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
SCHEMA = "bench_telemetry"
_ids = itertools.count()


def run(processor: BlockingProcessor, count: int, direct: bool) -> float:
    """Messages per second through the processor, one message per batch."""
    messages = [Message(f"m-{next(_ids)}", b"{}", source="orders") for _ in range(count)]
    started = time.perf_counter()
    for message in messages:
        if direct:
            processor._process([(message, None)], False, None)
        else:
            processor.process([(message, None)])
    return count / (time.perf_counter() - started)


def sdk_mode() -> Callable[[], None]:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])

    def on() -> None:
        exporter.clear()
        telemetry.instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)

    return on


def measure(label: str, engine: Engine, tables: Tables, count: int, rounds: int) -> list[Series]:
    install(engine, tables)
    dedup = Deduplicator(engine, consumer="bench", tables=tables)
    processor = BlockingProcessor(dedup.handler(lambda message, session: None))
    modes: dict[str, tuple[Callable[[], None], bool]] = {
        "direct": (telemetry.uninstrument, True),
        "off": (telemetry.uninstrument, False),
        "noop": (telemetry.instrument, False),
        "sdk": (sdk_mode(), False),
    }
    run(processor, min(count, 300), direct=True)  # warm-up
    found = {name: Series(f"{label}, {name}") for name in modes}
    for _ in range(rounds):
        for name, (setup, direct) in modes.items():
            setup()
            found[name].add(run(processor, count, direct))
    telemetry.uninstrument()
    return list(found.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=2000, help="per mode and round")
    parser.add_argument(
        "--url", help=f"PostgreSQL (default $CONSUMERDEDUP_BENCH_PG_URL or {DEFAULT_URL})"
    )
    add_round_arguments(parser, rounds=5)
    args = parser.parse_args()
    check_rounds(parser, args)
    count = 200 if args.quick else args.messages
    url = args.url or os.environ.get("CONSUMERDEDUP_BENCH_PG_URL", DEFAULT_URL)

    conditions = Conditions()
    pg = create_engine(url)
    conditions.postgres(pg)
    conditions.add("workload", f"{count} messages per mode and round, one per batch, no-op handler")
    conditions.print()
    with pg.begin() as conn:
        conn.execute(text(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
    sqlite = create_engine("sqlite://", poolclass=StaticPool)
    results = [
        measure("SQLite in memory", sqlite, Tables.define(), count, args.rounds),
        measure(
            "PostgreSQL",
            pg,
            Tables.define(f"{SCHEMA}.processed_events", f"{SCHEMA}.outbox"),
            count,
            args.rounds,
        ),
    ]
    for series in results:
        print_table(
            series[0].name.split(",")[0], series, baseline=series[0], baseline_label="vs direct"
        )
    print_pairs(
        "Telemetry / none (the same processor, same run)",
        [(s.name, s, series[0]) for series in results for s in series[1:]],
    )
    with pg.begin() as conn:
        conn.execute(text(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
    conditions.print_after()


if __name__ == "__main__":
    main()
