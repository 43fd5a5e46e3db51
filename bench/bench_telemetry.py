"""What telemetry costs per message on the runners' path (``BlockingProcessor.process``).

Run it: ``.venv/bin/python bench/bench_telemetry.py [--messages N] [--rounds R]``.
One message per batch (a runner's worst case: every hook runs per message), on
SQLite in memory, so the pipeline itself is as cheap as it gets and the hook's share
shows. Modes, round-robin, each on fresh ids:

- ``direct``: the processor's inner call, as the code was before the hooks;
- ``off``: ``process()`` with no telemetry (the hook slot read, found empty);
- ``noop``: ``telemetry.instrument()`` with OpenTelemetry's default (no-op) providers;
- ``sdk``: ``instrument()`` with the SDK, a SimpleSpanProcessor into memory and an
  in-memory metric reader (every span built, exported, every metric recorded).

A figure is the median of the rounds' microseconds per message; ratios are to ``direct``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from collections.abc import Callable

from sqlalchemy import create_engine
from sqlalchemy.pool import StaticPool

from consumerdedup import Deduplicator, Message, install, telemetry
from consumerdedup.dedup.processing import BlockingProcessor

_ids = itertools.count()


def run(processor: BlockingProcessor, count: int, direct: bool) -> float:
    messages = [Message(f"m-{next(_ids)}", b"{}", source="orders") for _ in range(count)]
    started = time.perf_counter()
    for message in messages:
        if direct:
            processor._process([(message, None)], False)
        else:
            processor.process([(message, None)])
    return (time.perf_counter() - started) / count * 1e6


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    engine = create_engine("sqlite://", poolclass=StaticPool)
    install(engine)
    dedup = Deduplicator(engine, consumer="bench")
    processor = BlockingProcessor(dedup.handler(lambda message, session: None))
    modes: dict[str, tuple[Callable[[], None], bool]] = {
        "direct": (telemetry.uninstrument, True),
        "off": (telemetry.uninstrument, False),
        "noop": (telemetry.instrument, False),
        "sdk": (sdk_mode(), False),
    }
    run(processor, 300, direct=True)  # warm-up
    found: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(args.rounds):
        for name, (setup, direct) in modes.items():
            setup()
            found[name].append(run(processor, args.messages, direct))
    telemetry.uninstrument()
    load = os.getloadavg()
    print(
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {os.cpu_count()} CPUs; "
        f"{args.rounds} rounds x {args.messages} messages, one per batch, SQLite in memory"
    )
    base = statistics.median(found["direct"])
    for name, values in found.items():
        median = statistics.median(values)
        print(
            f"{name:7s} {median:8.1f} us/message  (spread {min(values):.1f}-{max(values):.1f})"
            f"  x{median / base:.3f}  {median - base:+.1f} us"
        )


if __name__ == "__main__":
    main()
