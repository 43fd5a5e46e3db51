"""Round 11 attacks on asyncpg: errors swallowed on asyncpg's less common routes, in a batch.

m1's handler writes its row, then misbehaves on asyncpg's own connection; m0 and m2 write
their rows. Whatever m1 did, each message ends PROCESSED with its row once (and, for m1,
a kept row only if its statement was undone by a savepoint alone) or FAILED with none;
m0 and m2 are PROCESSED (invariant 4). Real PostgreSQL, postgresql+asyncpg.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import asyncpg
import pytest
from sqlalchemy import text

from consumerdedup import AsyncDeduplicator, Message, Outcome, Result, RetryPolicy
from tests.conftest import Database
from tests.support.async_drivers import async_engine

FAST = RetryPolicy(attempts=2, initial_delay=timedelta(0), max_delay=timedelta(0))
Route = Callable[[Any, str], Awaitable[None]]


async def executemany_swallowed(raw: Any, ledger: str) -> None:
    with contextlib.suppress(asyncpg.PostgresError):
        await raw.executemany(f"INSERT INTO {ledger} VALUES ((1 / $1::int)::text)", [(1,), (0,)])


async def prepared_executemany_swallowed(raw: Any, ledger: str) -> None:
    statement = await raw.prepare(f"INSERT INTO {ledger} VALUES ((1 / $1::int)::text)")
    with contextlib.suppress(asyncpg.PostgresError):
        await statement.executemany([(1,), (0,)])  # the server's error at the second row


async def cursor_swallowed(raw: Any, ledger: str) -> None:
    with contextlib.suppress(asyncpg.PostgresError):
        async for _row in raw.cursor("SELECT 1 / (g - 2) FROM generate_series(1, 3) g"):
            pass


async def copy_swallowed(raw: Any, ledger: str) -> None:
    table = ledger.split(".")[-1]
    schema = ledger.split(".")[0]
    with contextlib.suppress(asyncpg.PostgresError, asyncpg.InterfaceError, ValueError):
        await raw.copy_records_to_table(table, schema_name=schema, records=[(1,)])


async def savepoint_by_sql(raw: Any, ledger: str) -> None:
    await raw.execute("SAVEPOINT mine")
    with contextlib.suppress(asyncpg.PostgresError):
        await raw.execute("SELECT 1 / 0")
    await raw.execute("ROLLBACK TO SAVEPOINT mine")
    await raw.execute(f"INSERT INTO {ledger} VALUES ('m1-kept')")


async def asyncpg_transaction_block(raw: Any, ledger: str) -> None:
    with contextlib.suppress(asyncpg.PostgresError):
        async with raw.transaction():
            await raw.execute(f"INSERT INTO {ledger} VALUES ('m1-undone')")
            await raw.execute("SELECT 1 / 0")
    await raw.execute(f"INSERT INTO {ledger} VALUES ('m1-kept')")


async def rollback_to_a_batch_mates_savepoint(raw: Any, ledger: str) -> None:
    with contextlib.suppress(Exception):
        await raw.execute("ROLLBACK TO SAVEPOINT sa_savepoint_1")


async def fetch_in_a_failed_savepoint(raw: Any, ledger: str) -> None:
    await raw.execute("SAVEPOINT mine")
    with contextlib.suppress(asyncpg.PostgresError):
        await raw.fetchval("SELECT 1 / 0")
    with contextlib.suppress(asyncpg.PostgresError):  # 25P02: in the failed savepoint
        await raw.execute(f"INSERT INTO {ledger} VALUES ('m1-lost')")
    await raw.execute("RELEASE SAVEPOINT mine")  # refused by the server too: still aborted


ROUTES: dict[str, Route] = {
    f.__name__: f
    for f in (
        executemany_swallowed,
        prepared_executemany_swallowed,
        cursor_swallowed,
        copy_swallowed,
        savepoint_by_sql,
        asyncpg_transaction_block,
        rollback_to_a_batch_mates_savepoint,
        fetch_in_a_failed_savepoint,
    )
}


KEEPS = ("savepoint_by_sql", "asyncpg_transaction_block")
"""The routes whose error a savepoint undid alone: m1 goes on and writes 'm1-kept'."""


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_an_error_swallowed_on_asyncpgs_own_routes(pg: Database, route: str) -> None:
    ledger = pg.name("ledger")
    with pg.engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {ledger} (mid TEXT)"))
    insert = text(f"INSERT INTO {ledger} VALUES (:m)")

    async def go() -> tuple[list[Result], list[Result]]:
        engine = async_engine(pg.url, "asyncpg", pool_size=1, max_overflow=0)
        dedup = AsyncDeduplicator(engine, "apg", tables=pg.tables, retry=FAST)

        @dedup.handler
        async def handle(message: Message, session: Any) -> None:
            await session.execute(insert, {"m": message.id})
            if message.id == "m1":
                conn = await session.connection()
                raw = (await conn.get_raw_connection()).driver_connection
                with contextlib.suppress(Exception):  # what the guard refuses, too
                    await ROUTES[route](raw, ledger)

        batch = [Message(id=i, body=b"{}") for i in ("m0", "m1", "m2")]
        try:
            return await handle.process_batch(batch), await handle.process_batch(batch)
        finally:
            await engine.dispose()

    first, again = asyncio.run(go())
    outcome = {r.message.id: r.outcome for r in first}
    assert outcome["m0"] is Outcome.PROCESSED and outcome["m2"] is Outcome.PROCESSED, [
        r.reason for r in first
    ]
    with pg.engine.connect() as conn:
        rows = sorted(r[0] for r in conn.execute(text(f"SELECT mid FROM {ledger}")))
        pe = pg.name("processed_events")
        records = dict(conn.execute(text(f"SELECT message_id, outcome FROM {pe}")).all())
    assert rows.count("m0") == 1 and rows.count("m2") == 1
    assert "m1-undone" not in rows and "m1-lost" not in rows and "1" not in rows
    if outcome["m1"] is Outcome.PROCESSED:
        assert records["m1"] == "processed"
        assert rows.count("m1") == 1
        assert rows.count("m1-kept") == (1 if route in KEEPS else 0)
    else:
        assert outcome["m1"] is Outcome.FAILED, first[1].reason
        assert "m1" not in rows and "m1-kept" not in rows
    assert [r.outcome for r in again] == [
        Outcome.DUPLICATE,
        Outcome.DUPLICATE if outcome["m1"] is Outcome.PROCESSED else Outcome.FAILED,
        Outcome.DUPLICATE,
    ]
