"""Round 11 attack on PostgreSQL (asyncpg, and psycopg alike): a handler that changes its
session's client_encoding.

The setting outlives the transaction: the next message on the pooled connection was sent
in LATIN1, and one whose id LATIN1 cannot encode (an emoji) failed every attempt and was
reported FAILED, unrecorded (dead-lettered), for a fault not its own (invariant 8). The
change is now refused before it is sent (``SET client_encoding``, ``SET NAMES``,
``set_config('client_encoding', ...)``): the handler's own message fails, the next is
PROCESSED.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text

from consumerdedup import AsyncDeduplicator, Message, Outcome, RetryPolicy
from tests.conftest import Database
from tests.support.async_drivers import async_engine

FAST = RetryPolicy(attempts=2, initial_delay=timedelta(0), max_delay=timedelta(0))
CHANGES = [
    "SET client_encoding = 'LATIN1'",
    "SET SESSION client_encoding TO 'LATIN1'",
    "SET NAMES 'LATIN1'",
    "SELECT set_config('client_encoding', 'LATIN1', false)",
]


@pytest.mark.parametrize("route", ["session", "raw"])
@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
@pytest.mark.parametrize("statement", CHANGES)
def test_a_client_encoding_change_is_refused(
    pg: Database, statement: str, driver: str, route: str
) -> None:
    ledger = pg.name("ledger")
    with pg.engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {ledger} (mid TEXT)"))
    insert = text(f"INSERT INTO {ledger} VALUES (:m)")
    emoji = "caf\u00e9-\U0001f600"

    async def go() -> tuple[Outcome, Outcome, Outcome]:
        engine = async_engine(pg.url, driver, pool_size=1, max_overflow=0)
        dedup = AsyncDeduplicator(engine, "c", tables=pg.tables, retry=FAST)

        @dedup.handler
        async def handle(message: Message, session: Any) -> None:
            await session.execute(insert, {"m": message.id})
            if message.id != "first":
                return
            if route == "session":
                await session.execute(text(statement))
                return
            conn = await session.connection()
            raw = (await conn.get_raw_connection()).driver_connection
            if driver == "asyncpg":
                await raw.execute(statement)
            else:
                await raw.execute(statement.replace("%", "%%"))

        try:
            first = await handle(Message(id="first", body=b"x"))
            second = await handle(Message(id=emoji, body=b"x"))
            again = await handle(Message(id=emoji, body=b"x"))
            return first, second, again
        finally:
            await engine.dispose()

    assert asyncio.run(go()) == (Outcome.FAILED, Outcome.PROCESSED, Outcome.DUPLICATE)
    with pg.engine.connect() as conn:
        assert [r[0] for r in conn.execute(text(f"SELECT mid FROM {ledger}"))] == [emoji]
