"""Consume a Kafka topic into PostgreSQL: each payment applied once, however often it arrives.

    python examples/kafka_consumer.py [TOPIC]          # default topic: payments

Records carry their id in the ``event_id`` header and a JSON body such as
``{"account": "alice", "amount": 25}``. Settings from the environment:
KAFKA_BOOTSTRAP (default localhost:9092), CONSUMERDEDUP_DB_URL (default the
local ``test`` database), EXAMPLE_SCHEMA (where the tables go, default
example_kafka), KAFKA_GROUP (default: the consumer name),
KAFKA_IDEMPOTENCE=0 for brokers without idempotent producers (Tansu),
UNTIL_IDLE=1 to stop once the group has caught up. SIGTERM or Ctrl-C: the
batch in flight finishes and commits, then it exits 0.
"""

import asyncio
import os
import sys

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from consumerdedup import AsyncDeduplicator, Message, Outcome, Tables, install
from consumerdedup.adapters.kafka import KafkaConfig, KafkaConsumerRunner

TOPIC = sys.argv[1] if len(sys.argv) > 1 else "payments"
BOOTSTRAP = os.environ.get("KAFKA_BOOTSTRAP", "localhost:9092")
DB_URL = os.environ.get("CONSUMERDEDUP_DB_URL", "postgresql+psycopg://postgres@127.0.0.1/test")
SCHEMA = os.environ.get("EXAMPLE_SCHEMA", "example_kafka")


async def main() -> None:
    engine = create_async_engine(DB_URL)
    tables = Tables.define(f"{SCHEMA}.processed_events", f"{SCHEMA}.outbox")
    async with engine.begin() as conn:
        await conn.run_sync(install, tables)  # the schema and tables, if missing
        # No unique key on purpose: only the deduplicator keeps a payment from counting twice.
        await conn.execute(
            text(
                f"CREATE TABLE IF NOT EXISTS {SCHEMA}.payments "
                "(event_id TEXT, account TEXT, amount INT)"
            )
        )

    dedup = AsyncDeduplicator(engine, consumer="payments", tables=tables)

    @dedup.handler
    async def record_payment(message: Message, session: AsyncSession) -> None:
        payment = message.json()  # not JSON: DecodeError, the record goes to <topic>.dlq
        await session.execute(
            text(f"INSERT INTO {SCHEMA}.payments VALUES (:id, :account, :amount)"),
            {"id": message.id, "account": payment["account"], "amount": payment["amount"]},
        )

    runner = KafkaConsumerRunner(
        record_payment,
        TOPIC,
        bootstrap_servers=BOOTSTRAP,
        group_id=os.environ.get("KAFKA_GROUP"),
        config=KafkaConfig(
            batch_size=200,  # records per transaction, at most
            idempotent_producer=os.environ.get("KAFKA_IDEMPOTENCE", "1") != "0",
        ),
    )
    runner.on_signals()  # SIGTERM, SIGINT: finish the batch, commit, return
    print(f"consuming {TOPIC} from {BOOTSTRAP}", flush=True)
    await runner.run(until_idle=os.environ.get("UNTIL_IDLE") == "1")
    done = runner.outcomes
    print(
        f"applied {done[Outcome.PROCESSED]}, duplicates {done[Outcome.DUPLICATE]}, "
        f"dead-lettered {done[Outcome.FAILED]}"
    )
    await engine.dispose()


asyncio.run(main())
