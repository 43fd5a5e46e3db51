"""Telemetry: OpenTelemetry spans and metrics, Prometheus gauges, the readings behind them.

Nothing here imports opentelemetry or prometheus_client until asked: with the
extras not installed consumerdedup works as before. The parts:

* ``readings``: the queries ``stats`` runs (backlog, oldest, parked, records per consumer);
* ``prometheus``: those readings in the Prometheus text format and on ``/metrics``
  (the extra ``consumerdedup[prometheus]``).
"""
