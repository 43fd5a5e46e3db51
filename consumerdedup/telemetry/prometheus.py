"""The gauges operators alert on, in the Prometheus text format (``stats --format
prometheus``) and on ``/metrics`` (``relay`` and ``prune --every`` with
``--metrics-port``), through prometheus_client (the extra ``consumerdedup[prometheus]``).

Named by Prometheus conventions: the ``consumerdedup_`` prefix, base units
(``_seconds``), ``_total`` for counters, and labels that stay few (the table and
the consumer, never a message id).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from sqlalchemy import Engine

from .. import options
from ..errors import ConfigurationError
from ..schema import Tables
from .readings import Readings

PREFIX = "consumerdedup_"
INSTALL = "pip install 'consumerdedup[prometheus]'"


def _client() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise ConfigurationError(f"Prometheus metrics need prometheus_client: {INSTALL}") from None
    return prometheus_client


def families(readings: Readings, tables: Tables) -> Iterator[Any]:
    """The metric families of one reading (prometheus_client's GaugeMetricFamily)."""
    from prometheus_client.core import GaugeMetricFamily

    pe, ob = tables.processed_events.fullname, tables.outbox.fullname
    outbox = readings.outbox
    gauges: list[tuple[str, str, float | None]] = [
        ("outbox_backlog_events", "Outbox rows waiting to be published, parked not counted",
         outbox["unpublished"] - outbox["parked"]),
        ("outbox_oldest_unpublished_age_seconds",
         "Age of the oldest unpublished outbox row (0: none waits)",
         outbox["oldest_unpublished_age_seconds"] or 0.0),
        ("outbox_parked_events", "Outbox rows parked after repeated failures",
         outbox["parked"]),
        ("outbox_abandoned_events", "Outbox rows abandoned by an operator, never published",
         outbox["abandoned"]),
    ]  # fmt: skip
    for name, doc, value in gauges:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=["table"])
        family.add_metric([ob], float(value or 0))
        yield family
    rows = GaugeMetricFamily(
        PREFIX + "processed_events_rows", "Rows in processed_events per consumer",
        labels=["table", "consumer"],
    )  # fmt: skip
    failed = GaugeMetricFamily(
        PREFIX + "failed_records", "FAILED records in processed_events per consumer",
        labels=["table", "consumer"],
    )  # fmt: skip
    for consumer in readings.consumers:
        rows.add_metric([pe, consumer["consumer"]], float(consumer["rows"]))
        failed.add_metric([pe, consumer["consumer"]], float(consumer["failed"]))
    yield rows
    yield failed
    if readings.partitions is not None:
        default = GaugeMetricFamily(
            PREFIX + "processed_events_default_partition_rows",
            "Rows in the DEFAULT partition of a partitioned processed_events (should be 0)",
            labels=["table"],
        )
        default.add_metric([pe], float(readings.partitions["rows_in_default"]))
        yield default


def exposition(readings: Readings, tables: Tables) -> str:
    """One reading in the Prometheus text format (version 0.0.4)."""
    client = _client()
    registry = client.CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families(readings, tables))))
    text: bytes = client.generate_latest(registry)
    return text.decode("utf-8")


Counters = Callable[[], Mapping[str, tuple[str, float]]]
"""The command's own counters: name (without prefix and _total) -> (help, value)."""


class _Fixed:
    def __init__(self, found: list[Any]) -> None:
        self.found = found

    def collect(self) -> Iterator[Any]:
        yield from self.found


class TablesCollector:
    """Reads the tables at every scrape, plus the command's own counters."""

    def __init__(self, engine: Engine, tables: Tables, counters: Counters | None = None) -> None:
        self.engine, self.tables, self.counters = engine, tables, counters

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        up = GaugeMetricFamily(PREFIX + "database_up", "1 if the last scrape read the tables")
        try:
            readings = Readings.take(self.engine, self.tables)
        except Exception:  # a scrape while the database is away: say so, do not fail it
            up.add_metric([], 0.0)
            readings = None
        else:
            up.add_metric([], 1.0)
        yield up
        if readings is not None:
            yield from families(readings, self.tables)
        for name, (doc, value) in (self.counters() if self.counters else {}).items():
            yield CounterMetricFamily(PREFIX + name, doc, value=value)


def serve(
    port: int, engine: Engine, tables: Tables, counters: Counters | None = None,
    addr: str = "0.0.0.0",
) -> Callable[[], None]:  # fmt: skip
    """Serve ``/metrics`` on ``port`` in a daemon thread; returns what stops it."""
    options.integer(port, "serve(port)", at_least=0, at_most=65535)
    options.instance(engine, "serve(engine)", Engine, "a sqlalchemy Engine")
    options.instance(tables, "serve(tables)", Tables, "a Tables (Tables.define(...))")
    options.maybe(counters, "serve(counters)", options.function)
    options.text(addr, "serve(addr)")
    client = _client()
    registry = client.CollectorRegistry(auto_describe=False)
    registry.register(TablesCollector(engine, tables, counters))
    server, thread = client.start_http_server(port, addr=addr, registry=registry)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return stop
