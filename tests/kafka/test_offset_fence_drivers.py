"""The offset write of a chunk's transaction on each PostgreSQL driver (issue 36).

With ``KafkaConfig(offsets="database")`` the epoch's read and the offset write go to the
driver as SQL built once (offset_fence, driver_sql): on blocking psycopg, async psycopg
and asyncpg alike, a chunk of the owner writes its offset with its rows, and a chunk whose
partition a new owner took while its handler ran (after the epoch's read, so only the
offset write itself can fence it) commits nothing. No broker: OffsetStore and the
deduplicator's ``process_deliveries`` as the runner calls them.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import text

from consumerdedup import AsyncDeduplicator, Deduplicator, Message, Outcome
from consumerdedup.adapters.kafka.offsets import OffsetStore
from consumerdedup.dedup.offset_fence import PartitionFenced
from tests.support.async_drivers import async_engine

pytestmark = pytest.mark.postgres

DRIVERS = ["blocking psycopg", "async psycopg", "asyncpg"]


def chunk(first: int, count: int) -> list[tuple[Message, str | None]]:
    return [(Message(id=f"e-{i}", body=b"{}", offset=i), None) for i in range(first, first + count)]


@pytest.mark.parametrize("driver", DRIVERS)
async def test_the_owner_writes_its_offset_and_a_zombie_commits_nothing(
    pg: Any, driver: str
) -> None:
    ledger = pg.create_ledger()
    insert = text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', 1, :m)")
    engine: Any = (
        pg.engine if driver == "blocking psycopg" else async_engine(pg.url, driver.split()[-1])
    )
    store = OffsetStore(engine, pg.tables, "group-" + driver.replace(" ", "-"))
    steal: list[bool] = []  # set: the handler's call lets a new owner take the partition

    if driver == "blocking psycopg":
        dedup: Any = Deduplicator(engine, consumer="fence", tables=pg.tables)

        @dedup.bulk_handler
        def handle(messages: list[Message], session: Any) -> None:
            session.execute(insert, [{"m": m.id} for m in messages])
            if steal and steal.pop():  # the new owner bumps the epoch on its own connection
                asyncio.run(store.take([("orders", 0)]))

        async def process(*args: Any, **kwargs: Any) -> Any:
            return await asyncio.to_thread(handle.process_deliveries, *args, **kwargs)
    else:
        dedup = AsyncDeduplicator(engine, consumer="fence", tables=pg.tables)

        @dedup.bulk_handler
        async def handle(messages: list[Message], session: Any) -> None:
            await session.execute(insert, [{"m": m.id} for m in messages])
            if steal and steal.pop():
                await store.take([("orders", 0)])

        process = handle.process_deliveries

    try:
        owned = (await store.take([("orders", 0)]))["orders", 0]
        fence = store.fence("orders", 0, owned, claims=False)
        results = await process(chunk(0, 3), ordered=True, fence=fence)
        assert [r.outcome for r in results] == [Outcome.PROCESSED] * 3
        assert not fence.fenced
        assert (await store.stored("orders", 0)) == (3, owned.epoch)

        steal.append(True)
        fence = store.fence("orders", 0, owned, claims=False)
        results = await process(chunk(3, 2), ordered=True, fence=fence)
        assert [r.outcome for r in results] == [Outcome.RETRY] * 2
        assert all(isinstance(r.error, PartitionFenced) for r in results)
        assert fence.fenced
        assert not steal, "the handler did not run: the epoch's read fenced it, not the write"
        stored = await store.stored("orders", 0)
        assert stored is not None and stored[0] == 3 and stored[1] > owned.epoch
    finally:
        if driver != "blocking psycopg":
            await engine.dispose()
    with pg.engine.connect() as conn:
        rows = conn.execute(text(f"SELECT message_id FROM {ledger} ORDER BY message_id"))
        assert [r[0] for r in rows] == ["e-0", "e-1", "e-2"]  # the zombie's rows rolled back
