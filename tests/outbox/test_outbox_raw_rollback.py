"""A handler ends the pipeline's transaction through the raw DB-API connection, then adds an event.

Before: on PostgreSQL the failure's reason said the engine was in AUTOCOMMIT mode (the
pipeline's connection runs in driver autocommit for its pipelined BEGIN, so once the
handler's raw ``rollback()`` ended the transaction, Outbox.add's autocommit check fired)
and told the operator to change the engine, which was fine. Now the reason names what
happened and the fix; whatever the text, nothing of the handler commits: the message is
FAILED (its record, no effects, no outbox row) and its batch-mates commit with their events.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from consumerdedup import (
    AsyncDeduplicator,
    ConfigurationError,
    Deduplicator,
    Message,
    Outbox,
    Outcome,
)
from consumerdedup.errors import TransactionBroken
from tests.conftest import Database
from tests.core.test_pipeline_attacks import (
    FAST,
    assert_invariants,
    create_ledger,
    effects,
    order,
    records,
)

KINDS = [("sync", True), ("sync", False), ("async", True), ("async", False)]
KIND_IDS = ["sync-claim", "sync-check", "async-claim", "async-check"]
RAW = "through the raw DB-API connection"


def caught(swallow: bool) -> contextlib.AbstractContextManager[Any]:
    return contextlib.suppress(TransactionBroken) if swallow else contextlib.nullcontext()


def outbox_bodies(db: Database) -> list[bytes]:
    table = db.tables.outbox
    with db.engine.connect() as conn:
        return [bytes(r[0]) for r in conn.execute(select(table.c.body).order_by(table.c.id))]


def run(db: Database, kind: str, claim_first: bool, key: str | None, swallow: bool) -> Any:
    """[t1, t2, t3]: each writes its ledger row and adds an event; t2 first rolls the raw
    connection back (``swallow``: and catches Outbox.add's error, then returns)."""
    ledger = create_ledger(db)
    outbox = Outbox(db.tables)
    batch = [order("t1"), order("t2", raw=True), order("t3")]
    sql = text(f"INSERT INTO {ledger} (message_id) VALUES (:m)")
    if kind == "sync":
        dedup = Deduplicator(db.engine, "c", tables=db.tables, retry=FAST)

        def handle(message: Message, session: Session) -> None:
            session.execute(sql, {"m": message.id})
            if message.json().get("raw"):
                session.connection().connection.driver_connection.rollback()  # type: ignore[union-attr]
                with caught(swallow):
                    outbox.add(session, "events", message.id.encode(), key=key)
                return
            outbox.add(session, "events", message.id.encode(), key=key)

        return ledger, dedup.handler(claim_first=claim_first)(handle).process_batch(batch)
    engine = db.async_engine()

    async def go() -> Any:
        try:
            dedup = AsyncDeduplicator(engine, "c", tables=db.tables, retry=FAST)

            async def handle(message: Message, session: AsyncSession) -> None:
                await session.execute(sql, {"m": message.id})
                if message.json().get("raw"):
                    raw = await (await session.connection()).get_raw_connection()
                    await raw.driver_connection.rollback()  # type: ignore[union-attr]
                    with caught(swallow):
                        await outbox.add(session, "events", message.id.encode(), key=key)
                    return
                await outbox.add(session, "events", message.id.encode(), key=key)

            return await dedup.handler(claim_first=claim_first)(handle).process_batch(batch)
        finally:
            await engine.dispose()

    return ledger, asyncio.run(go())


@pytest.mark.parametrize("swallow", [False, True], ids=["raises", "swallowed"])
@pytest.mark.parametrize("key", [None, "k"], ids=["no-key", "key"])
@pytest.mark.parametrize(("kind", "claim_first"), KINDS, ids=KIND_IDS)
def test_a_raw_rollback_then_outbox_add_fails_alone_and_says_why(
    db: Database, kind: str, claim_first: bool, key: str | None, swallow: bool
) -> None:
    ledger, results = run(db, kind, claim_first, key, swallow)
    assert [r.outcome for r in results] == [Outcome.PROCESSED, Outcome.FAILED, Outcome.PROCESSED]
    failed = results[1]
    assert isinstance(failed.error, TransactionBroken), failed.reason
    assert "AUTOCOMMIT" not in failed.reason
    if not swallow:  # a swallowed error: the guard's own word when the handler returns
        assert RAW in failed.reason
        assert "never commit or roll back the raw connection" in failed.reason
    # Fail closed: nothing of t2 committed, its record says FAILED; its batch-mates committed.
    assert effects(db, ledger) == ["t1", "t3"]
    assert records(db)["t2"][0] == "failed"
    assert sorted(records(db)) == ["t1", "t2", "t3"]
    assert outbox_bodies(db) == [b"t1", b"t3"]
    assert_invariants(db, ledger, results)


def test_a_real_autocommit_engine_still_gets_the_autocommit_message(pg: Database) -> None:
    engine = create_engine(pg.url, connect_args={"autocommit": True})
    try:
        with Session(engine) as session, pytest.raises(ConfigurationError, match="AUTOCOMMIT"):
            Outbox(pg.tables).add(session, "events", b"{}", key="k")
    finally:
        engine.dispose()
    with pg.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(pg.tables.outbox)).scalar() == 0


def test_a_real_autocommit_async_engine_still_gets_the_autocommit_message(pg: Database) -> None:
    async def go() -> None:
        engine = create_async_engine(pg.async_url, connect_args={"autocommit": True})
        try:
            async with AsyncSession(engine) as session:
                with pytest.raises(ConfigurationError, match="AUTOCOMMIT"):
                    await Outbox(pg.tables).add(session, "events", b"{}")
        finally:
            await engine.dispose()

    asyncio.run(go())
    assert outbox_bodies(pg) == []
