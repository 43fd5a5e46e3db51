"""``consumerdedup run``'s supervisor, put together: the children's spec, the run's own
metrics directory, the probes, the reloader, the signals."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError
from .children import Child
from .supervisor import Outcome, Supervisor
from .worker import Spec

log = logging.getLogger("consumerdedup.run")
PROBES_HOST = "0.0.0.0"


@dataclass(frozen=True)
class Plan:
    """What ``consumerdedup run`` was asked, settings and flags merged."""

    app: str
    workers: int
    shutdown_timeout: float
    liveness_timeout: float
    health_port: int | None = None
    only: list[str] | None = None
    env_file: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    log_level: str = "INFO"
    log_format: str = "text"
    log_config: str | None = None
    verbose: bool = False
    reload: bool = False
    admin: Any = None
    """The admin pages' server (app/admin_page.py), not started: the supervisor serves them."""

    def spec(self, worker: int) -> Spec:
        return Spec(
            app=self.app, worker=worker, status_fd=-1, shutdown_timeout=self.shutdown_timeout,
            only=self.only, env_file=self.env_file, overrides=self.overrides,
            log_level=self.log_level, log_format=self.log_format, log_config=self.log_config,
            verbose=self.verbose,
        )  # fmt: skip


def serve(plan: Plan) -> Outcome:
    """Run the supervisor until it stops; its outcome (exit code and why)."""
    env = dict(os.environ)
    metrics_dir = None
    if plan.health_port is not None and _has_prometheus():
        metrics_dir = tempfile.mkdtemp(prefix="consumerdedup-metrics-")
        env["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # the children count into its files

    def launch(worker: int) -> Child:
        return Child(plan.spec(worker), env)

    supervisor = Supervisor(
        launch, plan.workers, plan.shutdown_timeout, plan.liveness_timeout, reload=plan.reload
    )
    supervisor.on_signals()
    probes = reloader = None
    try:
        if plan.health_port is not None:
            probes = _probes(plan.health_port, supervisor, metrics_dir)
        if plan.admin is not None:
            plan.admin.start()
        if plan.reload:
            from .reload import Reloader

            reloader = Reloader(Path.cwd(), supervisor.restart).start()
        log.info("running %s with %d worker(s)%s", plan.app, plan.workers,
                 f", parts {', '.join(plan.only)}" if plan.only else "")  # fmt: skip
        return supervisor.run()
    finally:
        if reloader is not None:
            reloader.stop()
        if probes is not None:
            probes.stop()
        if plan.admin is not None:
            plan.admin.stop()  # started or not: its engine is disposed
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def _has_prometheus() -> bool:
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        log.warning("/metrics needs prometheus_client: pip install 'consumerdedup[prometheus]'")
        return False
    return True


def _probes(port: int, supervisor: Supervisor, metrics_dir: str | None) -> Any:
    from .probes import Probes, registry

    if not 0 <= port < 65536:
        raise ConfigurationError(f"health port must be 0 to 65535, got {port}")
    metrics = registry(metrics_dir, supervisor.health) if metrics_dir else None
    try:
        probes = Probes(supervisor.health, metrics, PROBES_HOST, port).start()
    except OSError as error:
        raise ConfigurationError(f"health port {port}: cannot listen ({error.strerror})") from None
    log.info("health probes on http://%s:%d (/livez /readyz /metrics)", PROBES_HOST, probes.port)
    return probes
