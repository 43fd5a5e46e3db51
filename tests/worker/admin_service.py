"""A one-consumer service on the real App whose admin pages ``consumerdedup run``'s
supervisor serves (tests/worker/test_admin_page.py). A message ``bad`` fails for good
(FAILED, dead-lettered) until the file ADMIN_FIXED exists: the fix is deployed. Names from
ADMIN_QUEUE and ADMIN_SCHEMA; ``app.admin(...)`` declared only when ADMIN_DECLARE=1."""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.orm import Session
from starlette.requests import Request

from consumerdedup import App, Message, PermanentError, Tables
from consumerdedup.admin import Grant, RabbitMQReplay, Role

SCHEMA = os.environ.get("ADMIN_SCHEMA", "admin_service")
QUEUE = os.environ.get("ADMIN_QUEUE", "admin-service")
FIXED = Path(os.environ.get("ADMIN_FIXED", "/nonexistent/fixed"))
OPERATOR = Grant(Role.OPERATOR, "ops@example.com")

app = App("shop", tables=Tables.define(f"{SCHEMA}.processed_events", f"{SCHEMA}.outbox"))


@app.rabbitmq(queue=QUEUE, consumer="ledger", batch_size=10)
def apply(message: Message, session: Session) -> None:
    if message.body == b"bad" and not FIXED.exists():
        raise PermanentError("KeyError: 'sku' (the bad deploy)")
    session.execute(
        text(f"INSERT INTO {SCHEMA}.ledger (message_id) VALUES (:id)"), {"id": message.id}
    )


def authorize(request: Request) -> Role | Grant | None:
    """Stands for the service's own auth: a header naming who."""
    return {"ops": OPERATOR, "viewer": Role.VIEWER}.get(request.headers.get("x-user", ""))


if os.environ.get("ADMIN_DECLARE") == "1":
    app.admin(
        authorize=authorize,
        actions=True,
        replay=RabbitMQReplay(
            os.environ.get("CONSUMERDEDUP_RABBITMQ_URL", ""), {"ledger": QUEUE + ".dlq"}
        ),
    )
