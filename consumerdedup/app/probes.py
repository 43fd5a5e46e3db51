"""The supervisor's HTTP probes: ``/livez``, ``/readyz`` and ``/metrics``.

- ``/livez``: 200 while every child is alive and every part's loop ticked within the
  liveness timeout (a handler stuck for ever fails it; a part waiting out an outage
  does not); 503 otherwise, so the orchestrator restarts the pod.
- ``/readyz``: 200 once every child's every part passed its start checks and consumes;
  503 while the database or the broker is away, while a child restarts, and from the
  stop signal on.
- ``/metrics``: the Prometheus text of every child, restarted ones included, added up
  (prometheus_client's multiprocess mode), and the supervisor's own gauges.
Each probe answers JSON saying why (the Prometheus text for ``/metrics``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ..telemetry.prometheus import PREFIX
from .supervisor import Health

log = logging.getLogger("consumerdedup.probes")


class SupervisorCollector:
    """Gauges of the supervisor's own: parts ready and their loops' ages, restarts."""

    def __init__(self, health: Callable[[], Health]) -> None:
        self.health = health

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        health = self.health()
        ready = GaugeMetricFamily(
            PREFIX + "part_ready", "1 if the part passed its start checks and consumes",
            labels=["worker", "part"],
        )  # fmt: skip
        age = GaugeMetricFamily(
            PREFIX + "part_tick_age_seconds", "Seconds since the part's loop last turned",
            labels=["worker", "part"],
        )  # fmt: skip
        restarts = CounterMetricFamily(
            PREFIX + "worker_restarts", "Worker children started again after they died",
            labels=["worker"],
        )  # fmt: skip
        for entry in health.workers:
            worker = str(entry["worker"])
            restarts.add_metric([worker], float(entry["restarts"]))
            for name, part in (entry.get("parts") or {}).items():
                ready.add_metric([worker, name], 1.0 if part["ready"] else 0.0)
                age.add_metric([worker, name], float(part["tick_age"]))
        yield from (ready, age, restarts)


def registry(metrics_dir: str, health: Callable[[], Health]) -> Any:
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    found = CollectorRegistry(auto_describe=False)
    MultiProcessCollector(found, path=metrics_dir)  # type: ignore[no-untyped-call]
    found.register(SupervisorCollector(health))
    return found


class Probes:
    """The probes on ``port`` (0: one the OS picks; see ``port`` once started)."""

    def __init__(self, health: Callable[[], Health], metrics: Any, host: str, port: int) -> None:
        probes = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # http.server's name
                probes.answer(self)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("%s %s", self.address_string(), format % args)

        self.health, self.metrics = health, metrics
        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port: int = self.server.server_address[1]
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="probes", daemon=True
        )

    def start(self) -> Probes:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)

    def answer(self, request: BaseHTTPRequestHandler) -> None:
        path = request.path.split("?", 1)[0]
        if path == "/metrics":
            if self.metrics is None:
                return self._send(request, 404, {"error": "metrics need prometheus_client"})
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            body = generate_latest(self.metrics)
            return self._raw(request, 200, CONTENT_TYPE_LATEST, body)
        if path not in ("/livez", "/readyz"):
            return self._send(request, 404, {"error": "try /livez, /readyz or /metrics"})
        health = self.health()
        good = health.live if path == "/livez" else health.ready
        status = "ok" if good else "fail"
        self._send(request, 200 if good else 503, {"status": status, "workers": health.workers})

    def _send(self, request: BaseHTTPRequestHandler, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body, default=str).encode()
        self._raw(request, code, "application/json", data)

    def _raw(self, request: BaseHTTPRequestHandler, code: int, kind: str, body: bytes) -> None:
        request.send_response(code)
        request.send_header("Content-Type", kind)
        request.send_header("Content-Length", str(len(body)))
        request.send_header("Cache-Control", "no-store")
        request.end_headers()
        request.wfile.write(body)
