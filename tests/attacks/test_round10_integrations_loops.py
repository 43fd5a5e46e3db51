"""Round 10 attacks on ``process_once`` / ``process_once_async`` (docs/loops.md) against
the real PostgreSQL: nested calls, a cancelled asyncio handler.

Hole found here: ``once(message)`` called from inside a handler that ``once`` is running
for the same message (a loop's callback re-entering it, a Celery task applied eagerly from
its own body with the same key) never returned: the inner claim waited on the outer's
uncommitted record, and the outer on the inner call. It is refused now
(ConfigurationError in the handler: its message FAILED, recorded, its writes undone).
"""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from consumerdedup import (
    AsyncDeduplicator,
    ConfigurationError,
    Deduplicator,
    Message,
    Outcome,
    RetryPolicy,
    process_once,
    process_once_async,
)
from tests.conftest import Database

DEADLINE = 30.0
FAST = RetryPolicy(
    attempts=2, initial_delay=timedelta(0), max_delay=timedelta(0), breaker_threshold=None
)


def ledger_rows(pg: Database, ledger: str) -> list[str]:
    with pg.engine.connect() as conn:
        return [r[0] for r in conn.execute(text(f"SELECT account FROM {ledger} ORDER BY 1"))]


def records(pg: Database, consumer: str) -> list[tuple[str, str]]:
    with pg.engine.connect() as conn:
        found = conn.execute(
            text(
                f"SELECT message_id, outcome FROM {pg.tables.processed_events} "
                "WHERE consumer = :c ORDER BY 1"
            ),
            {"c": consumer},
        )
        return [(r[0], r[1]) for r in found]


def test_process_once_nested_on_its_own_message_is_refused_not_hung(pg: Database) -> None:
    ledger = pg.create_ledger()
    dedup = Deduplicator(pg.engine, "r10-nested", tables=pg.tables, retry=FAST)
    inner: list[BaseException | Outcome] = []

    @dedup.handler
    def handler(message: Message, session: Session) -> None:
        session.execute(text(f"INSERT INTO {ledger} (account) VALUES (:a)"), {"a": message.id})
        if message.headers.get("nest") and not inner:
            try:  # the same message again, from inside its own handler
                inner.append(once(Message(id=message.id, body=message.body)).outcome)
            except ConfigurationError as exc:
                inner.append(exc)
                raise

    once = process_once(handler)
    done: list[Any] = []
    worker = threading.Thread(
        target=lambda: done.append(once(Message(id="m-1", body=b"x", headers={"nest": "1"}))),
        daemon=True,  # the hole: it never returned
    )
    worker.start()
    worker.join(DEADLINE)
    assert not worker.is_alive(), "the nested call waited on its own claim forever"
    assert isinstance(inner[0], ConfigurationError), inner
    [result] = done
    # a handler that nests on its own message does so every time: FAILED, its writes undone
    assert result.outcome is Outcome.FAILED
    assert "still running" in str(result.reason)
    assert ledger_rows(pg, ledger) == []
    assert records(pg, "r10-nested") == [("m-1", "failed")]


def test_process_once_nested_on_another_message_commits_it_on_its_own(pg: Database) -> None:
    ledger = pg.create_ledger()
    dedup = Deduplicator(pg.engine, "r10-nested-other", tables=pg.tables)

    @dedup.handler
    def handler(message: Message, session: Session) -> None:
        session.execute(text(f"INSERT INTO {ledger} (account) VALUES (:a)"), {"a": message.id})
        if message.id == "outer":
            assert once(Message(id="inner", body=b"x")).outcome is Outcome.PROCESSED

    once = process_once(handler)
    assert once(Message(id="outer", body=b"x")).outcome is Outcome.PROCESSED
    assert ledger_rows(pg, ledger) == ["inner", "outer"]
    assert records(pg, "r10-nested-other") == [("inner", "processed"), ("outer", "processed")]


async def test_process_once_async_nested_on_its_own_message_is_refused(pg: Database) -> None:
    ledger = pg.create_ledger()
    engine = pg.async_engine()
    dedup = AsyncDeduplicator(engine, "r10-nested-async", tables=pg.tables, retry=FAST)
    inner: list[BaseException] = []

    @dedup.handler
    async def handler(message: Message, session: AsyncSession) -> None:
        await session.execute(
            text(f"INSERT INTO {ledger} (account) VALUES (:a)"), {"a": message.id}
        )
        if not inner:
            try:
                await once(Message(id=message.id, body=message.body))
            except ConfigurationError as exc:
                inner.append(exc)
                raise

    once = process_once_async(handler)
    try:
        result = await asyncio.wait_for(once(Message(id="a-1", body=b"x")), DEADLINE)
    finally:
        await engine.dispose()
    assert inner and isinstance(inner[0], ConfigurationError)
    assert result.outcome is Outcome.FAILED
    assert ledger_rows(pg, ledger) == []
    assert records(pg, "r10-nested-async") == [("a-1", "failed")]


async def test_process_once_async_cancelled_mid_handler_records_and_commits_nothing(
    pg: Database,
) -> None:
    ledger = pg.create_ledger()
    engine = pg.async_engine()
    dedup = AsyncDeduplicator(engine, "r10-cancel", tables=pg.tables)
    started = asyncio.Event()
    forever = asyncio.Event()

    @dedup.handler
    async def handler(message: Message, session: AsyncSession) -> None:
        await session.execute(
            text(f"INSERT INTO {ledger} (account) VALUES (:a)"), {"a": message.id}
        )
        await session.flush()
        if not started.is_set():
            started.set()
            await forever.wait()  # cancelled here, its write flushed, not committed

    once = process_once_async(handler)
    try:
        running = asyncio.create_task(once(Message(id="c-1", body=b"x")))
        await asyncio.wait_for(started.wait(), DEADLINE)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert ledger_rows(pg, ledger) == []
        assert records(pg, "r10-cancel") == []
        again = await asyncio.wait_for(once(Message(id="c-1", body=b"x")), DEADLINE)
    finally:
        await engine.dispose()
    assert again.outcome is Outcome.PROCESSED
    assert ledger_rows(pg, ledger) == ["c-1"]
    assert records(pg, "r10-cancel") == [("c-1", "processed")]
