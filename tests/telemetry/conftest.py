"""An OpenTelemetry SDK with in-memory exporters, instrumented for one test."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from consumerdedup import Outbox, install, telemetry
from consumerdedup.schema import DEFAULT, utcnow


@dataclass
class Otel:
    tracer_provider: TracerProvider
    spans_exporter: InMemorySpanExporter
    reader: InMemoryMetricReader

    def spans(self) -> list[ReadableSpan]:
        return list(self.spans_exporter.get_finished_spans())

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.spans() if s.name == name]

    def points(self, metric: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        found = []
        for resource in data.resource_metrics if data else []:
            for scope in resource.scope_metrics:
                for m in scope.metrics:
                    if m.name == metric:
                        found.extend(m.data.data_points)
        return found


def assert_two_hops(otel: Otel, orders: str, billing: str) -> None:
    """One trace from the request through both hops, printed as the test saw it."""
    (request_span,) = otel.named("POST /orders")
    shown = tree(otel.spans(), trace_of=request_span)
    print("\n" + shown)
    assert shown.splitlines() == [
        "POST /orders [INTERNAL]",
        f"  send {orders} [PRODUCER] links=1",
        f"    process {orders} [CONSUMER] outcome=processed",
        f"      send {billing} [PRODUCER] links=1",
        f"        process {billing} [CONSUMER] outcome=processed",
    ]


@pytest.fixture
def otel() -> Iterator[Otel]:
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    telemetry.instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)
    try:
        yield Otel(tracer_provider, exporter, reader)
    finally:
        telemetry.uninstrument()
        tracer_provider.shutdown()
        meter_provider.shutdown()


def tree(spans: list[ReadableSpan], trace_of: ReadableSpan | None = None) -> str:
    """The spans as an indented tree: name [kind] (links), children under their parent;
    only those of ``trace_of``'s trace if given."""
    if trace_of is not None:
        spans = [s for s in spans if s.context.trace_id == trace_of.context.trace_id]
    by_id = {s.context.span_id: s for s in spans}
    children: dict[int | None, list[ReadableSpan]] = {}
    for span in sorted(spans, key=lambda s: s.start_time or 0):
        parent = span.parent.span_id if span.parent and span.parent.span_id in by_id else None
        children.setdefault(parent, []).append(span)
    lines: list[str] = []

    def show(span: ReadableSpan, depth: int) -> None:
        kind = span.kind.name
        outcome = (span.attributes or {}).get("consumerdedup.outcome")
        extra = f" outcome={outcome}" if outcome else ""
        links = f" links={len(span.links)}" if span.links else ""
        lines.append(f"{'  ' * depth}{span.name} [{kind}]{extra}{links}")
        for child in children.get(span.context.span_id, []):
            show(child, depth + 1)

    for root in children.get(None, []):
        show(root, 0)
    return "\n".join(lines)


def seeded(tmp_path: Path) -> Any:
    engine = create_engine(f"sqlite:///{tmp_path / 'x.db'}")
    install(engine)
    pe = DEFAULT.processed_events
    with engine.begin() as conn:
        for n, outcome in enumerate(["processed", "processed", "failed"]):
            row = {"consumer": "ledger", "message_id": f"m{n}", "outcome": outcome}
            conn.execute(pe.insert().values(**row, processed_at=utcnow(), payload_hash="h"))
        conn.execute(
            pe.insert().values(
                consumer="audit",
                message_id="m0",
                outcome="processed",
                processed_at=utcnow(),
                payload_hash="h",
            )
        )
    with engine.begin() as conn, Session(bind=conn) as session:
        for n in range(3):
            Outbox().add(session, "cdd-nowhere", b"{}", key=f"k{n}")
        session.flush()
    return engine
