"""The operators' gauges as OpenTelemetry observable gauges, read back through the SDK."""

from __future__ import annotations

from pathlib import Path

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from consumerdedup import telemetry
from tests.telemetry.conftest import seeded


def test_the_table_gauges_read_back_through_the_sdk(tmp_path: Path) -> None:
    engine = seeded(tmp_path)
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    try:
        telemetry.observe_tables(engine, meter_provider=provider)
        data = reader.get_metrics_data()
    finally:
        provider.shutdown()
    assert data is not None
    found: dict[str, dict[tuple[tuple[str, object], ...], float]] = {}
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                found[metric.name] = {
                    tuple(sorted((p.attributes or {}).items())): p.value
                    for p in metric.data.data_points
                }
    assert found["consumerdedup.outbox.backlog"] == {(("table", "outbox"),): 3}
    assert found["consumerdedup.outbox.parked"] == {(("table", "outbox"),): 0}
    (age,) = found["consumerdedup.outbox.oldest_unpublished_age"].values()
    assert 0 <= age < 60
    rows = found["consumerdedup.processed_events.rows"]
    ledger = (("consumerdedup.consumer", "ledger"), ("table", "processed_events"))
    assert rows[ledger] == 3
    assert found["consumerdedup.processed_events.failed"][ledger] == 1
    assert "consumerdedup.processed_events.default_partition_rows" not in found  # SQLite
