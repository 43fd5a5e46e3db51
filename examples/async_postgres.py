"""AsyncDeduplicator on PostgreSQL with a batch: one transaction, one commit, then the acks.

Run with CONSUMERDEDUP_DB_URL=postgresql+psycopg://user@host/db (default: local test db).
"""

import asyncio
import os

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from consumerdedup import AsyncDeduplicator, Message, Tables, install

URL = os.environ.get("CONSUMERDEDUP_DB_URL", "postgresql+psycopg://postgres@127.0.0.1/test")


async def main() -> None:
    engine = create_async_engine(URL)
    tables = Tables.define("example_async.processed_events", "example_async.outbox")
    async with engine.begin() as conn:
        await conn.run_sync(install, tables)
        await conn.execute(text("DROP TABLE IF EXISTS example_async.shipments"))
        await conn.execute(text("CREATE TABLE example_async.shipments (order_id TEXT)"))
        await conn.execute(text("DELETE FROM example_async.processed_events"))

    dedup = AsyncDeduplicator(engine, consumer="shipping", tables=tables)

    @dedup.handler
    async def ship(message: Message, session: AsyncSession) -> None:
        await session.execute(
            text("INSERT INTO example_async.shipments VALUES (:id)"), {"id": message.id}
        )

    batch = [Message(id=f"order-{n % 50}", body=b"{}") for n in range(100)]  # each id twice
    outcomes = await ship.batch(batch)
    async with engine.connect() as conn:
        count = (await conn.execute(text("SELECT count(*) FROM example_async.shipments"))).scalar()
    print(f"outcomes: {dedup.counts}; shipments: {count}")
    assert count == 50 and len(outcomes) == 100
    async with engine.begin() as conn:
        await conn.execute(text("DROP SCHEMA example_async CASCADE"))
    await engine.dispose()


asyncio.run(main())
