"""Round 4 of attacks on the pipeline and the handler guard (issue 19's restructuring),
through the public API, on the real PostgreSQL and on SQLite: each test is one way a
handler could have an effect lost or doubled, or an outcome recorded wrongly."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text

from consumerdedup import AsyncDeduplicator, Deduplicator, Message, Outcome, RetryPolicy
from consumerdedup.errors import TransactionBroken
from tests.conftest import Database

FAST = RetryPolicy(attempts=3, initial_delay=timedelta(0), max_delay=timedelta(0))


def _message(mid: str) -> Message:
    return Message(id=mid, body=json.dumps({"id": mid}).encode(), source="orders")


def _ledger(db: Database) -> list[str]:
    with db.engine.connect() as conn:
        return sorted(
            r[0] for r in conn.exec_driver_sql(f"SELECT message_id FROM {db.name('ledger')}")
        )


def _records(db: Database) -> dict[str, str]:
    pe = db.tables.processed_events
    with db.engine.connect() as conn:
        return {r.message_id: r.outcome for r in conn.execute(pe.select())}


def _run(
    db: Database,
    kind: str,
    claim_first: bool,
    sync_fn: Callable[[Message, Any], None],
    async_fn: Callable[[Message, Any], Any],
    ids: list[str],
) -> list[Any]:
    if kind == "sync":
        dedup = Deduplicator(db.engine, "round4", tables=db.tables, retry=FAST)
        return dedup.handler(claim_first=claim_first)(sync_fn).process_batch(
            [_message(i) for i in ids]
        )
    engine = db.async_engine()
    adedup = AsyncDeduplicator(engine, "round4", tables=db.tables, retry=FAST)
    handle = adedup.handler(claim_first=claim_first)(async_fn)

    async def go() -> list[Any]:
        try:
            return await handle.process_batch([_message(i) for i in ids])
        finally:
            await engine.dispose()

    return asyncio.run(go())


KINDS = [("sync", True), ("sync", False), ("async", True), ("async", False)]
KIND_IDS = ["sync-claim", "sync-check", "async-claim", "async-check"]


def _insert(db: Database, mid: str) -> Any:
    return text(f"INSERT INTO {db.name('ledger')} (message_id) VALUES ('{mid}')")


# A handler that ends the session's transaction, then goes on in a new one ----------------


@pytest.mark.parametrize("end", ["rollback", "close"])
@pytest.mark.parametrize(("kind", "claim_first"), KINDS, ids=KIND_IDS)
def test_writes_after_ending_the_transaction_never_commit(
    db: Database, kind: str, claim_first: bool, end: str
) -> None:
    """Before: after ``session.rollback()`` (or ``close()``) the session began a new
    transaction on a connection no listener was on, so the handler's
    ``session.connection().commit()`` went through: 'b-again' was committed on each of
    b's 3 attempts while b was recorded FAILED (invariant 2)."""
    db.create_ledger()

    def handle(message: Message, session: Any) -> None:
        session.execute(_insert(db, message.id))
        if message.id == "b":
            getattr(session, end)()
            session.execute(_insert(db, "b-again"))
            session.connection().commit()

    async def handle_async(message: Message, session: Any) -> None:
        await session.execute(_insert(db, message.id))
        if message.id == "b":
            await getattr(session, end)()
            await session.execute(_insert(db, "b-again"))
            await (await session.connection()).commit()

    results = _run(db, kind, claim_first, handle, handle_async, ["a", "b", "c"])
    assert [r.outcome for r in results] == [Outcome.PROCESSED, Outcome.FAILED, Outcome.PROCESSED]
    assert isinstance(results[1].error, TransactionBroken), results[1].reason
    assert _ledger(db) == ["a", "c"]
    assert _records(db) == {"a": "processed", "b": "failed", "c": "processed"}


# A handler that commits through the raw DB-API connection, mid-batch ----------------------


@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
def test_a_raw_dbapi_commit_mid_batch_loses_or_doubles_nothing(
    db: Database, claim_first: bool
) -> None:
    """Before: the raw commit() was caught only after it had committed: claim-first
    committed every claim of the batch (c reported DUPLICATE, its handler never run: its
    effect lost); check-first committed a's effect without its record (a run again:
    doubled). Both databases."""
    db.create_ledger()

    def handle(message: Message, session: Any) -> None:
        session.execute(_insert(db, message.id))
        if message.id == "b":
            session.connection().connection.dbapi_connection.commit()

    results = _run(db, "sync", claim_first, handle, handle, ["a", "b", "c"])
    stored = _records(db)
    done = _ledger(db)
    for result in results:
        key = result.message.id
        if result.outcome in (Outcome.PROCESSED, Outcome.DUPLICATE):
            assert done.count(key) == 1 and stored[key] == "processed", (key, done, stored)
        elif result.outcome is Outcome.FAILED:
            assert done.count(key) == 0 and stored[key] == "failed", (key, done, stored)
    assert [r.outcome for r in results] == [Outcome.PROCESSED, Outcome.FAILED, Outcome.PROCESSED]
