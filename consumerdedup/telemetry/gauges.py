"""The gauges operators alert on as OpenTelemetry observable gauges: the same readings as
``stats`` and ``/metrics`` (``readings.py``), taken once per collection.

``consumerdedup.telemetry.observe_tables(engine)`` registers them; the SDK's reader calls
back at each collection, and one reading of the tables serves every gauge of it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation
from sqlalchemy import Engine

from ..schema import Tables
from .readings import Readings

FRESH = 1.0
"""Seconds one reading serves the gauges of a collection (they are called one by one)."""


class TableGauges:
    def __init__(self, engine: Engine, tables: Tables, meter: metrics.Meter) -> None:
        self.engine, self.tables = engine, tables
        self._lock = threading.Lock()
        self._taken: tuple[float, Readings | None] = (float("-inf"), None)
        ob, pe = {"table": tables.outbox.fullname}, tables.processed_events.fullname

        def outbox(key: Callable[[dict[str, Any]], float]) -> Callable[..., Iterable[Observation]]:
            def observe(options: CallbackOptions) -> Iterable[Observation]:
                found = self.reading()
                return [Observation(key(found.outbox), ob)] if found else []

            return observe

        def per_consumer(key: str) -> Callable[..., Iterable[Observation]]:
            def observe(options: CallbackOptions) -> Iterable[Observation]:
                found = self.reading()
                return [
                    Observation(c[key], {"table": pe, "consumerdedup.consumer": c["consumer"]})
                    for c in (found.consumers if found else [])
                ]

            return observe

        def default_rows(options: CallbackOptions) -> Iterable[Observation]:
            found = self.reading()
            if found is None or found.partitions is None:
                return []
            return [Observation(found.partitions["rows_in_default"], {"table": pe})]

        gauge = meter.create_observable_gauge
        gauge(
            "consumerdedup.outbox.backlog",
            [outbox(lambda o: o["unpublished"] - o["parked"])],
            unit="{event}",
            description="Outbox rows waiting to be published, parked not counted",
        )
        gauge(
            "consumerdedup.outbox.oldest_unpublished_age",
            [outbox(lambda o: o["oldest_unpublished_age_seconds"] or 0.0)],
            unit="s",
            description="Age of the oldest unpublished outbox row (0: none waits)",
        )
        gauge(
            "consumerdedup.outbox.parked",
            [outbox(lambda o: o["parked"])],
            unit="{event}",
            description="Outbox rows parked after repeated failures",
        )
        gauge(
            "consumerdedup.processed_events.failed",
            [per_consumer("failed")],
            unit="{record}",
            description="FAILED records per consumer",
        )
        gauge(
            "consumerdedup.processed_events.rows",
            [per_consumer("rows")],
            unit="{row}",
            description="Rows in processed_events per consumer",
        )
        gauge("consumerdedup.processed_events.default_partition_rows", [default_rows],
              unit="{row}", description="Rows in the DEFAULT partition (should be 0)")  # fmt: skip

    def reading(self) -> Readings | None:
        """A reading at most FRESH old; None if the tables cannot be read (no observation)."""
        with self._lock:
            at, found = self._taken
            if time.monotonic() - at > FRESH:
                try:
                    found = Readings.take(self.engine, self.tables)
                except Exception:  # the database away: this collection has no table gauges
                    found = None
                self._taken = (time.monotonic(), found)
            return found
