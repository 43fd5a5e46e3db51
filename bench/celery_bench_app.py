"""The Celery app bench/bench_celery.py's worker runs (``celery -A bench.celery_bench_app
worker``), configured by environment variables: two tasks inserting the same row, one
in its own transaction (plain), one through IdempotentTask (its session)."""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from sqlalchemy import create_engine, text

from consumerdedup import Tables
from consumerdedup.celery import IdempotentTask

app = Celery("cdd_bench", broker=os.environ.get("CDD_BENCH_BROKER", "memory://"))
app.conf.update(
    task_acks_late=True,  # what IdempotentTask requires, for both tasks alike
    task_reject_on_worker_lost=True,
    task_ignore_result=True,
    worker_prefetch_multiplier=4,
    broker_connection_retry_on_startup=True,
)
_schema = os.environ.get("CDD_BENCH_SCHEMA", "public")
_table = f"{_schema}.rows"
engine = create_engine(os.environ.get("CDD_BENCH_DB", "sqlite://"), pool_size=4)
tables = Tables.define(f"{_schema}.processed_events", f"{_schema}.outbox")


@app.task(name="bench.plain")
def plain(n: int) -> None:
    with engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {_table} (n) VALUES (:n)"), {"n": n})


@app.task(name="bench.dedup", base=IdempotentTask, bind=True, engine=engine, tables=tables)
def dedup(self: Any, n: int) -> None:
    self.session.execute(text(f"INSERT INTO {_table} (n) VALUES (:n)"), {"n": n})
