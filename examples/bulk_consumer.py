"""A bulk handler: one call per transaction, its rows written with one multi-row INSERT.

The handler gets the batch's new messages only (duplicates and twins are left out by
the claim), in delivery order. It writes every order with one INSERT of many rows and
updates the customers' totals in key order, so two consumers over the same customers
take the rows' locks in one order. An order it cannot take it names with
BatchMessageFailed: only that one fails, the rest of its batch commits.

Runs on SQLite by default; set CONSUMERDEDUP_DB_URL to a PostgreSQL URL to use it.
"""

import json
import os
from collections import Counter
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from consumerdedup import BatchMessageFailed, Deduplicator, Message, PermanentError, install
from consumerdedup.testing import MemoryBroker, MemoryConfig, MemoryConsumerRunner

engine = create_engine(os.environ.get("CONSUMERDEDUP_DB_URL", "sqlite://"))
install(engine)
with engine.begin() as conn:
    conn.execute(text("DROP TABLE IF EXISTS bulk_orders"))
    conn.execute(text("DROP TABLE IF EXISTS bulk_customers"))
    conn.execute(text("CREATE TABLE bulk_orders (id TEXT, customer TEXT, total INTEGER)"))
    conn.execute(text("CREATE TABLE bulk_customers (id TEXT PRIMARY KEY, spent INTEGER)"))
    conn.execute(
        text("INSERT INTO bulk_customers VALUES (:id, 0)"),
        [{"id": f"cust-{n}"} for n in range(7)],
    )

dedup = Deduplicator(engine, consumer="bulk-orders")
add_order = text("INSERT INTO bulk_orders VALUES (:id, :customer, :total)")
add_spent = text("UPDATE bulk_customers SET spent = spent + :total WHERE id = :customer")


@dedup.bulk_handler
def place_orders(messages: list[Message], session: Session) -> None:
    orders: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        order = message.json()
        if order["total"] < 0:  # this order alone fails; no bisection needed
            raise BatchMessageFailed(index, PermanentError(f"negative total in {order['id']}"))
        orders.append(order)
    session.execute(add_order, orders)  # one multi-row INSERT (executemany)
    spent = Counter[str]()
    for order in orders:
        spent[order["customer"]] += order["total"]
    # Our own row locks in key order: consumers sharing customers wait, never deadlock.
    session.execute(add_spent, [{"customer": c, "total": spent[c]} for c in sorted(spent)])


broker = MemoryBroker(duplicate_rate=0.3, seed=7)  # 30% of acked messages come again
for n in range(200):
    order = {"id": f"order-{n}", "customer": f"cust-{n % 7}", "total": -1 if n == 42 else n}
    broker.publish("orders", json.dumps(order).encode(), message_id=f"evt-{n}")

runner = MemoryConsumerRunner(
    place_orders, "orders", broker=broker, config=MemoryConfig(batch_size=50)
)
runner.run(until_idle=True)

with engine.connect() as conn:
    count, distinct = conn.execute(
        text("SELECT count(*), count(DISTINCT id) FROM bulk_orders")
    ).one()
    spent_total = conn.execute(text("SELECT sum(spent) FROM bulk_customers")).scalar()
dead_letters = broker.messages("orders.dlq")
print(f"deliveries: {broker.delivered}, counts: {dedup.counts}")
print(f"orders: {count} ({distinct} distinct), dead letters: {len(dead_letters)}")
assert count == distinct == 199 and len(dead_letters) == 1  # order-42 alone failed
assert spent_total == sum(range(200)) - 42  # each order counted once
print(f"spent: {spent_total}")
