"""The service bench_run.py runs both ways: a RabbitMQ consumer that writes one row a message.

``consumerdedup run run_service:app`` (from bench/) runs it through the App; run_by_hand.py
builds the same Deduplicator and RabbitConsumerRunner around the same function by hand.
Names from BENCH_QUEUE and BENCH_SCHEMA.
"""

from __future__ import annotations

import os

from sqlalchemy import text
from sqlalchemy.orm import Session

from consumerdedup import App, Message, Tables

SCHEMA = os.environ.get("BENCH_SCHEMA", "bench_run")
QUEUE = os.environ.get("BENCH_QUEUE", "bench-run")
BATCH_SIZE, PREFETCH = 100, 200
tables = Tables.define(f"{SCHEMA}.processed_events", f"{SCHEMA}.outbox")
app = App("bench", tables=tables)


@app.rabbitmq(queue=QUEUE, consumer="ledger", batch_size=BATCH_SIZE, prefetch=PREFETCH)
def apply(message: Message, session: Session) -> None:
    session.execute(
        text(f"INSERT INTO {SCHEMA}.ledger (message_id, body) VALUES (:id, :body)"),
        {"id": message.id, "body": message.body.decode()},
    )
