"""Round 5: held-back outbox events (issue 23's hold-back to COMMIT) against savepoints.

A keyed ``Outbox.add`` inside a dedup handler on PostgreSQL is queued, not written,
until just before COMMIT. A savepoint the handler rolls back must still take the
event with it, whichever way the savepoint was made: the session's
``begin_nested()``, the connection's ``begin_nested()``, or SQL (which cannot be
followed by name, so it is refused, never guessed)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from consumerdedup import (
    AsyncDeduplicator,
    Deduplicator,
    Message,
    Outbox,
    Outcome,
    Tables,
    install,
)
from tests.conftest import Database, database


@pytest.fixture
def pg(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    yield from database(request, "postgresql", tmp_path)


def _bodies(db: Database) -> list[bytes]:
    with db.engine.connect() as conn:
        rows = conn.execute(db.tables.outbox.select().order_by(db.tables.outbox.c.id))
        return [bytes(r.body) for r in rows]


def _sync(db: Database, way: str) -> Any:
    outbox = Outbox(db.tables)

    def handler(message: Message, session: Any) -> None:
        outbox.add(session, "orders", b"kept", key="k")
        if way == "connection":
            savepoint = session.connection().begin_nested()
            outbox.add(session, "orders", b"undone", key="k")
            savepoint.rollback()
        elif way == "nested-in-released":
            outer = session.connection().begin_nested()
            inner = session.connection().begin_nested()
            outbox.add(session, "orders", b"undone", key="k")
            inner.commit()
            outer.rollback()
        else:  # SQL
            session.execute(text("SAVEPOINT a"))
            outbox.add(session, "orders", b"undone", key="k")
            session.execute(text("ROLLBACK TO SAVEPOINT a"))

    dedup = Deduplicator(db.engine, "round5", tables=db.tables)
    handle = dedup.handler(handler)
    first = handle(Message(id="m0", body=b"{}"))  # the pooled connection seen once before
    with db.engine.begin() as conn:
        conn.execute(db.tables.outbox.delete())
    return first if first is not Outcome.PROCESSED else handle(Message(id="m1", body=b"{}"))


def _async(db: Database, way: str) -> Any:
    outbox = Outbox(db.tables)
    engine = db.async_engine()

    async def handler(message: Message, session: Any) -> None:
        await outbox.add(session, "orders", b"kept", key="k")
        if way == "connection":
            savepoint = await (await session.connection()).begin_nested()
            await outbox.add(session, "orders", b"undone", key="k")
            await savepoint.rollback()
        elif way == "nested-in-released":
            connection = await session.connection()
            outer = await connection.begin_nested()
            inner = await connection.begin_nested()
            await outbox.add(session, "orders", b"undone", key="k")
            await inner.commit()
            await outer.rollback()
        else:
            await session.execute(text("SAVEPOINT a"))
            await outbox.add(session, "orders", b"undone", key="k")
            await session.execute(text("ROLLBACK TO SAVEPOINT a"))

    dedup = AsyncDeduplicator(engine, "round5", tables=db.tables)

    async def go() -> Any:
        handle = dedup.handler(handler)
        try:
            first = await handle(Message(id="m0", body=b"{}"))  # the connection seen before
            async with engine.begin() as conn:
                await conn.execute(db.tables.outbox.delete())
            if first is not Outcome.PROCESSED:
                return first
            return await handle(Message(id="m1", body=b"{}"))
        finally:
            await engine.dispose()

    return asyncio.run(go())


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("way", ["connection", "nested-in-released"])
def test_an_event_in_a_rolled_back_connection_savepoint_is_not_written(
    pg: Database, kind: str, way: str
) -> None:
    outcome = (_sync if kind == "sync" else _async)(pg, way)
    assert outcome is Outcome.PROCESSED
    assert _bodies(pg) == [b"kept"]


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_savepoint_sent_as_sql_with_a_held_event_fails_closed(pg: Database, kind: str) -> None:
    outcome = (_sync if kind == "sync" else _async)(pg, "sql")
    assert outcome is Outcome.FAILED  # refused, not written past its savepoint
    assert _bodies(pg) == []
    reason = pg.scalar(f"SELECT error FROM {pg.name('processed_events')}")
    assert "begin_nested" in str(reason)


@pytest.mark.parametrize("tenancy", ["per-message", "one-tenant"])
def test_a_held_event_goes_to_the_outbox_its_search_path_named_at_add(
    pg: Database, tenancy: str
) -> None:
    """Held-back rows are inserted at COMMIT, so a handler's SET LOCAL search_path (a
    tenant per message) would send its batch-mates' held events to its own tenant's
    unqualified outbox: such a message goes again in a transaction of its own."""
    tenants = [f"{pg.schema}_a", f"{pg.schema}_b"]
    for tenant in tenants:
        install(pg.engine, Tables.define(f"{tenant}.processed_events", f"{tenant}.outbox"))
    try:
        outbox = Outbox(Tables.define(f"{pg.schema}.processed_events", "outbox"))

        def handler(message: Message, session: Any) -> None:
            tenant = tenants[int(message.id[1:]) if tenancy == "per-message" else 0]
            session.execute(text(f"SET LOCAL search_path TO {tenant}"))
            outbox.add(session, "orders", message.id.encode(), key="k")

        dedup = Deduplicator(pg.engine, "round5", tables=pg.tables)
        messages = [Message(id=f"m{i}", body=b"{}") for i in range(2)]
        results = dedup.handler(handler).process_batch(messages)
        assert {r.outcome for r in results} == {Outcome.PROCESSED}
        if tenancy == "one-tenant":  # the same path again changes nothing: no retry
            assert [r.attempts for r in results] == [1, 1]
        with pg.engine.connect() as conn:
            found = [
                conn.execute(text(f"SELECT body FROM {tenant}.outbox")).scalars().all()
                for tenant in tenants
            ]
        expected = [[b"m0"], [b"m1"]] if tenancy == "per-message" else [[b"m0", b"m1"], []]
        assert [[bytes(b) for b in bodies] for bodies in found] == expected
    finally:
        with pg.engine.begin() as conn:
            for tenant in tenants:
                conn.execute(text(f"DROP SCHEMA IF EXISTS {tenant} CASCADE"))
