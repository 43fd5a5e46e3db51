"""Telemetry: OpenTelemetry spans and metrics, Prometheus gauges, the readings behind them.

Nothing here imports opentelemetry or prometheus_client until asked: with the
extras not installed consumerdedup works as before. The parts:

* ``readings``: the queries ``stats`` runs (backlog, oldest, parked, records per consumer);
* ``prometheus``: those readings in the Prometheus text format and on ``/metrics``
  (the extra ``consumerdedup[prometheus]``);
* ``instrument()``: OpenTelemetry spans and metrics (the extra ``consumerdedup[otel]``)
  through the ``hooks`` the message path reads (``tracing``, ``metrics``, ``attributes``).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine

from ..schema import Tables
from . import hooks


def instrument(tracer_provider: Any = None, meter_provider: Any = None) -> None:
    """Spans and metrics from now on, through the given providers or OpenTelemetry's
    global ones (``consumerdedup[otel]``: opentelemetry-api). Idempotent; every runner,
    relay and ``Outbox.add`` of the process reports to it."""
    try:
        from opentelemetry import metrics, trace
    except ImportError:
        from ..errors import ConfigurationError

        raise ConfigurationError(
            "telemetry needs the OpenTelemetry API: pip install 'consumerdedup[otel]'"
        ) from None
    from .events import add_trace_context, http_decision
    from .metrics import SCOPE, Instruments
    from .tracing import Tracing

    tracer = trace.get_tracer(SCOPE, tracer_provider=tracer_provider)
    meter = metrics.get_meter(SCOPE, meter_provider=meter_provider)
    idle = None
    if tracer_provider is None and meter_provider is None:
        globals_now = (trace.get_tracer_provider(), metrics.get_meter_provider())
        # OpenTelemetry's proxies until the application sets its SDK: nothing to record yet.
        if (
            isinstance(globals_now[0], trace.ProxyTracerProvider)
            and "Proxy" in type(globals_now[1]).__name__
        ):
            idle = globals_now
    tracing = Tracing(tracer, Instruments(meter), idle)
    hooks.process = tracing
    hooks.send = tracing.send
    hooks.outbox_headers = add_trace_context
    hooks.http_decision = http_decision
    hooks.http_lease_expired = tracing.instruments.lease_expired
    hooks.breaker = tracing.instruments.breaker


def observe_tables(engine: Engine, tables: Tables | None = None, meter_provider: Any = None) -> Any:
    """The gauges operators alert on (backlog, oldest unpublished age, parked events,
    FAILED records and rows per consumer, rows in DEFAULT) as OpenTelemetry observable
    gauges, read from ``tables`` at each collection. Returns what registered them."""
    try:
        from opentelemetry import metrics
    except ImportError:
        from ..errors import ConfigurationError

        raise ConfigurationError(
            "telemetry needs the OpenTelemetry API: pip install 'consumerdedup[otel]'"
        ) from None
    from .. import options
    from ..schema import DEFAULT
    from .gauges import TableGauges
    from .metrics import SCOPE

    options.instance(engine, "observe_tables(engine)", Engine, "a sqlalchemy Engine")
    options.maybe(tables, "observe_tables(tables)", options.instance, Tables, "a Tables or None")

    meter = metrics.get_meter(SCOPE, meter_provider=meter_provider)
    return TableGauges(engine, tables if tables is not None else DEFAULT, meter)


def uninstrument() -> None:
    """Back to no telemetry at all: the hooks empty again."""
    hooks.process = None
    hooks.send = None
    hooks.outbox_headers = None
    hooks.http_decision = None
    hooks.http_lease_expired = None
    hooks.breaker = None
