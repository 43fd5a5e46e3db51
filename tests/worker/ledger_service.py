"""A one-consumer service on the real App, for the worker's tests of what only a real runner
shows: its loop's tick stopping in a handler that hangs, its start checks meeting a missing
table, a database away at start. Names from LEDGER_QUEUE and LEDGER_SCHEMA."""

from __future__ import annotations

import os
import threading

from sqlalchemy import text
from sqlalchemy.orm import Session

from consumerdedup import App, Message, Tables

SCHEMA = os.environ.get("LEDGER_SCHEMA", "ledger_service")
app = App("ledger", tables=Tables.define(f"{SCHEMA}.processed_events", f"{SCHEMA}.outbox"))


@app.rabbitmq(queue=os.environ.get("LEDGER_QUEUE", "ledger"), consumer="ledger", batch_size=10)
def apply(message: Message, session: Session) -> None:
    if message.body == b"hang":
        threading.Event().wait()  # a handler stuck for ever: its loop stops ticking
    session.execute(
        text(f"INSERT INTO {SCHEMA}.ledger (message_id) VALUES (:id)"), {"id": message.id}
    )
