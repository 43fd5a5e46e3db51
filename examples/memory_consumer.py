"""A consumer loop on the in-memory broker, with duplicates and a crash injected.

The same shape as a Kafka or RabbitMQ runner: fetch, run the batch in one
transaction, then ack, dead-letter or give back each delivery.
"""

import json

from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from consumerdedup import Deduplicator, Message, SimulatedCrash, install
from consumerdedup.testing import MemoryBroker, MemoryConfig, MemoryConsumerRunner

engine = create_engine("sqlite://")
install(engine)
with engine.begin() as conn:
    # No unique key on purpose: only the deduplicator keeps an order from being placed twice.
    conn.execute(text("CREATE TABLE orders (id TEXT, total INTEGER)"))

dedup = Deduplicator(engine, consumer="orders")


@dedup.handler
def place_order(message: Message, session: Session) -> None:
    order = message.json()
    session.execute(text("INSERT INTO orders VALUES (:id, :total)"), order)


broker = MemoryBroker(duplicate_rate=0.3, seed=1)  # 30% of acked messages come again
for n in range(100):
    order = {"id": f"order-{n}", "total": n * 10}
    broker.publish("orders", json.dumps(order).encode(), message_id=f"evt-{n}")
broker.crash_before_ack()  # the first consumer dies after its first commit

for _ in range(2):  # the crash, then the restarted consumer
    runner = MemoryConsumerRunner(
        place_order, "orders", broker=broker, config=MemoryConfig(batch_size=10)
    )
    try:
        runner.run(until_idle=True)
    except SimulatedCrash:
        print("consumer crashed between commit and ack; restarting")

with engine.connect() as conn:
    count, distinct = conn.execute(text("SELECT count(*), count(DISTINCT id) FROM orders")).one()
dead_letters = broker.messages("orders.dlq")
print(f"deliveries: {broker.delivered}, counts: {dedup.counts}")
print(f"orders: {count} ({distinct} distinct), dead letters: {len(dead_letters)}")
assert count == distinct == 100 and not dead_letters  # each order once, none given up on
