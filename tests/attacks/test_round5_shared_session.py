"""Round 5: two deduplicators sharing one scoped_session, one's handler calling the other's.

The inner pipeline got the session the outer one's transaction was in: its COMMIT
committed the outer claim halfway (the outer message then answered DUPLICATE) and its
fresh queue of held-back outbox events replaced the outer one's, whose event was never
written though its record said processed. A session another pipeline's attempt is using
is refused now (ConfigurationError, before the inner pipeline touches it), and the outer
message fails alone: nothing of it recorded as processed, no event of either written."""

from __future__ import annotations

import asyncio
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import async_scoped_session, async_sessionmaker
from sqlalchemy.orm import scoped_session, sessionmaker

from consumerdedup import (
    AsyncDeduplicator,
    ConfigurationError,
    Deduplicator,
    Message,
    Outbox,
    Outcome,
)
from tests.conftest import Database


def _state(db: Database) -> tuple[dict[tuple[str, str], str], list[bytes]]:
    pe, ob = db.tables.processed_events, db.tables.outbox
    with db.engine.connect() as conn:
        records = {(r.consumer, r.message_id): r.outcome for r in conn.execute(pe.select())}
        bodies = [bytes(b) for b in conn.execute(select(ob.c.body)).scalars()]
    return records, bodies


def test_sync_a_shared_session_in_a_transaction_is_refused(db: Database) -> None:
    outbox = Outbox(db.tables)
    factory = scoped_session(sessionmaker(db.engine))
    outer = Deduplicator(db.engine, "outer", tables=db.tables, session_factory=factory)
    inner = Deduplicator(db.engine, "inner", tables=db.tables, session_factory=factory)
    inner_handle = inner.handler(lambda m, s: outbox.add(s, "orders", b"inner", key="i"))
    refused: list[Exception] = []

    def handler(message: Message, session: Any) -> None:
        outbox.add(session, "orders", b"outer", key="o")
        try:
            inner_handle(message)
        except ConfigurationError as exc:  # a handler that goes on anyway
            refused.append(exc)

    outcome = outer.handler(handler)(Message(id="m1", body=b"{}"))
    assert refused and "another deduplicator" in str(refused[0])
    records, bodies = _state(db)
    assert outcome is not Outcome.PROCESSED and outcome is not Outcome.DUPLICATE
    assert ("outer", "m1") not in records or records[("outer", "m1")] == "failed"
    assert ("inner", "m1") not in records and bodies == []


def test_async_a_shared_session_in_a_transaction_is_refused(db: Database) -> None:
    outbox = Outbox(db.tables)
    engine = db.async_engine()
    factory = async_scoped_session(async_sessionmaker(engine), scopefunc=lambda: "one")
    outer = AsyncDeduplicator(engine, "outer", tables=db.tables, session_factory=factory)
    inner = AsyncDeduplicator(engine, "inner", tables=db.tables, session_factory=factory)

    async def add_inner(message: Message, session: Any) -> None:
        await outbox.add(session, "orders", b"inner", key="i")

    inner_handle = inner.handler(add_inner)
    refused: list[Exception] = []

    async def handler(message: Message, session: Any) -> None:
        await outbox.add(session, "orders", b"outer", key="o")
        try:
            await inner_handle(message)
        except ConfigurationError as exc:
            refused.append(exc)

    async def go() -> Outcome:
        try:
            return await outer.handler(handler)(Message(id="m1", body=b"{}"))
        finally:
            await engine.dispose()

    outcome = asyncio.run(go())
    assert refused and "another deduplicator" in str(refused[0])
    records, bodies = _state(db)
    assert outcome is not Outcome.PROCESSED and outcome is not Outcome.DUPLICATE
    assert ("outer", "m1") not in records or records[("outer", "m1")] == "failed"
    assert ("inner", "m1") not in records and bodies == []
