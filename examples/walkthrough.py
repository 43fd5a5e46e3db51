"""End to end: a consumer writes an outbox event, the relay publishes it, a downstream
consumer handles it, and the pruner keeps the tables small. docs/walkthrough.md runs
through it step by step; in production each part is its own process (docs/deployment.md).

SQLite and the in-memory broker here, so it runs anywhere: swap in PostgreSQL and
KafkaConsumerRunner / RabbitConsumerRunner and KafkaPublisher / RabbitPublisher.
"""

import json
from datetime import timedelta

from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from consumerdedup import Deduplicator, Message, Outbox, OutboxRelay, Pruner, install
from consumerdedup.testing import MemoryBroker, MemoryConfig, MemoryConsumerRunner

engine = create_engine("sqlite:///walkthrough.db")  # or "postgresql+psycopg://user@host/db"
install(engine)  # processed_events and outbox, if missing
with engine.begin() as conn:
    conn.execute(
        text("CREATE TABLE IF NOT EXISTS orders (id VARCHAR(64) PRIMARY KEY, total INTEGER)")
    )
    conn.execute(text("CREATE TABLE IF NOT EXISTS shipments (order_id VARCHAR(64) PRIMARY KEY)"))

broker = MemoryBroker(duplicate_rate=0.2, seed=3)  # 20% of acked messages come again
outbox = Outbox()

# 1. The orders consumer: its write and its outgoing event commit in one transaction.
orders = Deduplicator(engine, consumer="orders")


@orders.handler
def place_order(message: Message, session: Session) -> None:
    order = message.json()
    session.execute(text("INSERT INTO orders VALUES (:id, :total)"), order)
    outbox.add(session, "order-events", message.body, key=order["id"])


for n in range(20):
    body = json.dumps({"id": f"order-{n}", "total": 10 * n}).encode()
    broker.publish("orders", body, message_id=f"evt-{n}")
config = MemoryConfig(batch_size=10)
runner = MemoryConsumerRunner(place_order, "orders", broker=broker, config=config)
runner.run(until_idle=True)

# 2. The relay: publishes committed outbox rows, at least once, in order per key.
with OutboxRelay(engine, broker) as relay:
    published = relay.drain()  # in production: relay.run() until SIGTERM

# 3. The downstream consumer: dedups the events by their event_id header.
shipping = Deduplicator(engine, consumer="shipping")


@shipping.handler
def ship(message: Message, session: Session) -> None:
    session.execute(text("INSERT INTO shipments VALUES (:id)"), message.json())


MemoryConsumerRunner(ship, "order-events", broker=broker, config=MemoryConfig()).run(
    until_idle=True
)

# 4. The pruner: drops dedup records past the broker's retention + a buffer.
pruner = Pruner(engine, timedelta(days=7))  # in production: pruner.run(every=timedelta(hours=1))
pruned = pruner.prune()  # nothing yet: every record is younger than 7 days + 1 day

with engine.connect() as conn:
    placed = conn.execute(text("SELECT count(*) FROM orders")).scalar_one()
    shipped = conn.execute(text("SELECT count(*) FROM shipments")).scalar_one()
print(f"deliveries: {broker.delivered}, orders: {placed}, events published: {published}")
print(f"shipments: {shipped}, records pruned: {pruned}")
assert placed == shipped == 20  # each order placed and shipped once, despite redeliveries
