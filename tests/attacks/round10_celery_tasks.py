"""The Celery app of test_round10_integrations_celery.py's real worker (``celery -A
tests.attacks.round10_celery_tasks worker``), configured by environment variables; the
test builds the same app with ``build`` to send tasks and to name it to ``failed replay``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from celery import Celery
from sqlalchemy import create_engine, text

from consumerdedup import Tables
from consumerdedup.celery import IdempotentTask


def _unkeyable(order: str, password: str) -> str:
    raise ValueError(f"no key in {order!r} {password!r}")  # quotes the arguments


def build(env: Mapping[str, str]) -> tuple[Celery, dict[str, Any]]:
    schema, marks = env["R10_CELERY_SCHEMA"], Path(env["R10_CELERY_MARKS"])
    app = Celery("r10_celery", broker=env["R10_CELERY_BROKER"], backend=env["R10_CELERY_BACKEND"])
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_default_queue=env["R10_CELERY_QUEUE"],
        task_time_limit=60,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
    )
    engine = create_engine(env["R10_CELERY_DB"])
    tables = Tables.define(f"{schema}.processed_events", f"{schema}.outbox")
    ledger = f"{schema}.ledger"
    dedup = {"base": IdempotentTask, "bind": True, "engine": engine, "tables": tables}

    def write(task: Any, order: str) -> None:
        task.session.execute(
            text(f"INSERT INTO {ledger} (account, amount) VALUES (:o, 1)"), {"o": order}
        )

    @app.task(name="r10.retrying", default_retry_delay=0, max_retries=3, **dedup)
    def retrying(self: Any, order: str) -> str:
        write(self, order)
        runs = len(list(marks.glob(f"retrying-{order}.*")))
        (marks / f"retrying-{order}.{runs}").touch()
        if runs < 2:
            raise self.retry(countdown=0)  # Celery's own retry, inside the transaction
        return f"charged after {runs} retries"

    @app.task(name="r10.unkeyable", key=_unkeyable, **dedup)
    def unkeyable(self: Any, order: str, password: str) -> None:
        write(self, order)

    return app, {"retrying": retrying, "unkeyable": unkeyable}


if "R10_CELERY_QUEUE" in os.environ:
    app, tasks = build(os.environ)
