"""The Celery app of tests/integrations/test_celery.py: its worker runs this module
(``celery -A tests.integrations.celery_tasks worker``), configured by environment
variables; the test process builds the same app with ``build`` to send tasks and read
results. Every task writes a ledger row on ``self.session``."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from celery import Celery
from sqlalchemy import create_engine, event, text

from consumerdedup import PermanentError, RetryLater, Tables
from consumerdedup.celery import IdempotentTask


def _runs(marks: Path, name: str) -> int:
    """How many times the body named ``name`` ran before, counted in files (across kills)."""
    runs = len(list(marks.glob(f"{name}.*")))
    (marks / f"{name}.{runs}").touch()
    return runs


def build(env: Mapping[str, str]) -> tuple[Celery, dict[str, Any]]:
    schema, marks = env["CDD_CELERY_SCHEMA"], Path(env["CDD_CELERY_MARKS"])
    app = Celery(
        "cdd_celery_test", broker=env["CDD_CELERY_BROKER"], backend=env["CDD_CELERY_BACKEND"]
    )
    app.conf.update(
        task_acks_late="acks_late" not in env.get("CDD_CELERY_UNSAFE", ""),
        task_reject_on_worker_lost="reject" not in env.get("CDD_CELERY_UNSAFE", ""),
        task_default_queue=env["CDD_CELERY_QUEUE"],
        task_time_limit=60,
        worker_prefetch_multiplier=1,
        result_extended=True,
        broker_connection_retry_on_startup=True,
    )
    if "CDD_CELERY_VT" in env:
        app.conf.broker_transport_options = {"visibility_timeout": float(env["CDD_CELERY_VT"])}
    engine = create_engine(env["CDD_CELERY_DB"])
    tables = Tables.define(f"{schema}.processed_events", f"{schema}.outbox")
    ledger = f"{schema}.ledger"
    dedup = {"base": IdempotentTask, "bind": True, "engine": engine, "tables": tables}

    def write(task: Any, order_id: str, amount: int) -> None:
        task.session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES (:o, :a, :id)"),
            {"o": order_id, "a": amount, "id": task.request.id},
        )

    @app.task(name="cdd.charge", **dedup)
    def charge(
        self: Any, order_id: str, amount: int, crash: bool = False, crash_mid: bool = False
    ) -> dict[str, Any]:
        write(self, order_id, amount)
        if crash_mid and _runs(marks, f"crash-mid-{order_id}") == 0:
            self.session.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # written, not committed: dies mid-task
        if crash and _runs(marks, f"crash-{order_id}") == 0:  # die after COMMIT, before ack
            kill = lambda session: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
            event.listen(self.session, "after_commit", kill)
        return {"order_id": order_id, "amount": amount}

    @app.task(name="cdd.declined", **dedup)
    def declined(self: Any, order_id: str, token: str = "") -> None:
        write(self, order_id, 1)
        if not (marks / "fixed").exists():
            raise PermanentError("card declined")

    @app.task(name="cdd.flaky", default_retry_delay=0, max_retries=5, **dedup)
    def flaky(self: Any, order_id: str, busy: int) -> str:
        write(self, order_id, 1)
        if _runs(marks, f"flaky-{order_id}") < busy:
            raise RetryLater("the bank is busy")
        return "charged"

    @app.task(name="cdd.held", **dedup)
    def held(self: Any, order_id: str) -> str:
        """Writes, then holds its transaction open until the test releases it."""
        write(self, order_id, 1)
        deadline = time.monotonic() + 60
        while not (marks / f"release-{order_id}").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return "held"

    by_order = {"key": lambda order_id, amount: f"order:{order_id}"}

    @app.task(name="cdd.by_order", **dedup, **by_order)
    def charge_by_order(self: Any, order_id: str, amount: int) -> None:
        write(self, order_id, amount)

    tasks = {
        "charge": charge,
        "declined": declined,
        "flaky": flaky,
        "by_order": charge_by_order,
        "held": held,
    }
    return app, tasks


if "CDD_CELERY_QUEUE" in os.environ:
    app, tasks = build(os.environ)
