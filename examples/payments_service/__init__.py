"""A payments service: one module, one command.

    cd examples
    export CONSUMERDEDUP_DATABASE_URL=postgresql://payments@127.0.0.1/payments
    export CONSUMERDEDUP_RABBITMQ_URL=amqp://guest:guest@127.0.0.1:5672/%2F
    export CONSUMERDEDUP_KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:9092
    python -m payments_service.schema          # its tables and consumerdedup's, once
    consumerdedup run payments_service:app --workers 2 --health-port 8080

Three parts:

- ``payments``: card payments from the RabbitMQ queue ``payments``. Each is applied
  once to the ``payments`` table, however often it is delivered, and announces
  itself on Kafka (``payment-events``, keyed by account) through the outbox: the
  row and the event commit together or not at all.
- ``orders``: order lines from the Kafka topic ``orders``, written in bulk (one
  multi-row INSERT a batch, duplicates already filtered out).
- ``relay``: publishes the outbox's events to Kafka.

A body that does not validate (a negative amount, a missing field) is that message's
permanent failure: dead-lettered with the fields at fault, never a crash.

The names can be changed by environment (``PAYMENTS_*`` below): the tests run the
service on names of their own. ``PAYMENTS_KAFKA_IDEMPOTENCE=0`` for a broker without
idempotent producers (Tansu).
"""

from __future__ import annotations

import json
import os
from decimal import Decimal

from pydantic import BaseModel, Field
from sqlalchemy import text
from sqlalchemy.orm import Session

from consumerdedup import App, Outbox, Tables

SCHEMA = os.environ.get("PAYMENTS_SCHEMA", "payments_service")
QUEUE = os.environ.get("PAYMENTS_QUEUE", "payments")
ORDERS_TOPIC = os.environ.get("PAYMENTS_ORDERS_TOPIC", "orders")
ORDERS_GROUP = os.environ.get("PAYMENTS_ORDERS_GROUP", "orders")  # the Kafka consumer group
EVENTS_TOPIC = os.environ.get("PAYMENTS_EVENTS_TOPIC", "payment-events")
IDEMPOTENCE = os.environ.get("PAYMENTS_KAFKA_IDEMPOTENCE", "1") != "0"
KAFKA_GROUP = {
    # A short session: a member that died is replaced quickly (the default is 10 s).
    "session_timeout_ms": int(os.environ.get("PAYMENTS_KAFKA_SESSION_TIMEOUT_MS", "10000")),
    "heartbeat_interval_ms": int(os.environ.get("PAYMENTS_KAFKA_HEARTBEAT_MS", "3000")),
}

tables = Tables.define(f"{SCHEMA}.processed_events", f"{SCHEMA}.outbox")
outbox = Outbox(tables=tables)
app = App("payments-service", tables=tables)


class Payment(BaseModel):
    payment_id: str = Field(min_length=1, max_length=64)
    account: str = Field(min_length=1, max_length=64)
    amount: Decimal = Field(gt=0, max_digits=12, decimal_places=2)
    currency: str = Field(pattern="^[A-Z]{3}$")


class OrderLine(BaseModel):
    order_id: str = Field(min_length=1, max_length=64)
    sku: str
    quantity: int = Field(gt=0)


@app.rabbitmq(queue=QUEUE, consumer="payments", batch_size=50, prefetch=200)
def settle_payment(payment: Payment, session: Session) -> None:
    session.execute(
        text(
            f"INSERT INTO {SCHEMA}.payments (payment_id, account, amount, currency) "
            "VALUES (:payment_id, :account, :amount, :currency)"
        ),
        payment.model_dump(),
    )
    event = {"type": "payment.settled", **payment.model_dump(mode="json")}
    outbox.add(session, EVENTS_TOPIC, json.dumps(event).encode(), key=payment.account)


@app.kafka(
    topics=[ORDERS_TOPIC],
    consumer="orders",
    group_id=ORDERS_GROUP,
    bulk=True,
    batch_size=200,
    idempotent_producer=IDEMPOTENCE,  # its dead-letter producer
    consumer_options=KAFKA_GROUP,
)
def record_orders(lines: list[OrderLine], session: Session) -> None:
    session.execute(
        text(
            f"INSERT INTO {SCHEMA}.order_lines (order_id, sku, quantity) "
            "VALUES (:order_id, :sku, :quantity)"
        ),
        [line.model_dump() for line in lines],
    )


app.relay(to="kafka", publisher_options={"enable_idempotence": IDEMPOTENCE})
