"""Consume a RabbitMQ queue into PostgreSQL: each order is inserted once, however often it comes.

    python examples/rabbitmq_consumer.py [QUEUE]        (default queue: example.orders)

URLs from CONSUMERDEDUP_AMQP_URL and CONSUMERDEDUP_DB_URL, else the local servers; tables
in the schema EXAMPLE_SCHEMA (default example_rabbitmq), made afresh on every run. It
publishes 100 orders, 20 of them twice as a retrying producer would, then consumes until
the queue is empty. A real worker runs until SIGTERM instead:
``runner.on_signals(); runner.run()``.
"""

import json
import os
import sys

from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from consumerdedup import Deduplicator, Message, Outcome, Tables, install
from consumerdedup.adapters.rabbitmq import RabbitConfig, RabbitConsumerRunner, RabbitPublisher

AMQP_URL = os.environ.get("CONSUMERDEDUP_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
DB_URL = os.environ.get("CONSUMERDEDUP_DB_URL", "postgresql+psycopg://postgres@127.0.0.1/test")
QUEUE = sys.argv[1] if len(sys.argv) > 1 else "example.orders"
SCHEMA = os.environ.get("EXAMPLE_SCHEMA", "example_rabbitmq")

engine = create_engine(DB_URL)
with engine.begin() as conn:  # a fresh demo: a previous run's records would answer DUPLICATE
    conn.execute(text(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
tables = Tables.define(f"{SCHEMA}.processed_events", f"{SCHEMA}.outbox")
install(engine, tables)  # the schema, processed_events and outbox
with engine.begin() as conn:
    # No unique key on purpose: only the deduplicator keeps an order from being placed twice.
    conn.execute(text(f"CREATE TABLE {SCHEMA}.orders (id TEXT, total INT)"))

dedup = Deduplicator(engine, consumer="orders", tables=tables)


@dedup.handler
def place_order(message: Message, session: Session) -> None:
    order = message.json()
    session.execute(text(f"INSERT INTO {SCHEMA}.orders VALUES (:id, :total)"), order)


# Batches of up to 25 messages per transaction; the queue and QUEUE.dlq are declared.
config = RabbitConfig(prefetch=50, batch_size=25, declare=True)
runner = RabbitConsumerRunner(place_order, QUEUE, url=AMQP_URL, config=config)
runner.declare()  # so that the orders below have a queue to go to

with RabbitPublisher(AMQP_URL) as publisher:
    for n in range(120):
        order = {"id": f"order-{n % 100}", "total": n % 100 * 10}
        # message_id is the event id: the same order published again is the same message.
        publisher.publish(QUEUE, json.dumps(order).encode(), headers={"event_id": order["id"]})

runner.run(until_idle=True)

with engine.connect() as conn:
    placed = text(f"SELECT count(*), count(DISTINCT id) FROM {SCHEMA}.orders")
    count, distinct = conn.execute(placed).one()
done = runner.outcomes
print(
    f"processed {done[Outcome.PROCESSED]}, duplicates {done[Outcome.DUPLICATE]}, "
    f"dead-lettered {done[Outcome.FAILED]}, retried {done[Outcome.RETRY]}; "
    f"orders: {count} ({distinct} distinct)"
)
assert count == distinct == 100  # each order placed once
