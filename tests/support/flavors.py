"""Run one test body against both deduplicators: blocking and asyncio.

A test describes its handler as a *behavior*: ``behavior(message)`` returns
the SQL the handler should run (or raises), and each flavor runs that SQL on
its own kind of session. So every pipeline test covers Deduplicator and
AsyncDeduplicator without two copies of the test.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import text

from consumerdedup import AsyncDeduplicator, Deduplicator, Message, Result
from tests.support.async_drivers import async_engine

Behavior = Callable[[Message], Sequence[tuple[str, dict[str, Any]]]]

# A step's SQL may carry one of these, for handlers that misbehave as real ones do.
SWALLOW = "swallow: "
"""Prefix: run the statement and ignore its error (``except IntegrityError: pass``)."""
NESTED = "nested: "
"""Prefix: run it in ``session.begin_nested()`` and ignore its error (the right way)."""
COMMIT = "session.commit()"
ROLLBACK = "session.rollback()"


def _step(sql: str) -> tuple[str, str]:
    for prefix in (SWALLOW, NESTED):
        if sql.startswith(prefix):
            return prefix, sql[len(prefix) :]
    return "", sql


def run_step(session: Any, sql: str, params: dict[str, Any]) -> None:
    if sql in (COMMIT, ROLLBACK):
        session.commit() if sql == COMMIT else session.rollback()
        return
    how, sql = _step(sql)
    try:
        if how == NESTED:
            with session.begin_nested():
                session.execute(text(sql), params)
        else:
            session.execute(text(sql), params)
    except Exception:
        if not how:
            raise


async def run_step_async(session: Any, sql: str, params: dict[str, Any]) -> None:
    if sql in (COMMIT, ROLLBACK):
        await (session.commit() if sql == COMMIT else session.rollback())
        return
    how, sql = _step(sql)
    try:
        if how == NESTED:
            async with session.begin_nested():
                await session.execute(text(sql), params)
        else:
            await session.execute(text(sql), params)
    except Exception:
        if not how:
            raise


class SyncFlavor:
    name = "sync"

    def __init__(self, db: Any, claim_first: bool = True) -> None:
        self.db = db
        self.claim_first = claim_first

    def deduplicator(self, **options: Any) -> Deduplicator:
        options.setdefault("tables", self.db.tables)
        return Deduplicator(self.db.engine, **options)

    def wrap(self, behavior: Behavior, claim_first: bool | None = None, **options: Any) -> Any:
        dedup = self.deduplicator(**options)
        claim_first = self.claim_first if claim_first is None else claim_first

        @dedup.handler(claim_first=claim_first)
        def handle(message: Message, session: Any) -> None:
            for sql, params in behavior(message):
                run_step(session, sql, params)

        return _Runner(handle.process, handle.process_batch, dedup)

    def close(self) -> None:
        pass


class AsyncFlavor:
    name = "async"

    def __init__(self, db: Any, claim_first: bool = True) -> None:
        self.db = db
        self.claim_first = claim_first
        self.loop = asyncio.new_event_loop()
        self.engine = db.async_engine()

    def deduplicator(self, **options: Any) -> AsyncDeduplicator:
        options.setdefault("tables", self.db.tables)
        return AsyncDeduplicator(self.engine, **options)

    def wrap(self, behavior: Behavior, claim_first: bool | None = None, **options: Any) -> Any:
        dedup = self.deduplicator(**options)
        claim_first = self.claim_first if claim_first is None else claim_first

        @dedup.handler(claim_first=claim_first)
        async def handle(message: Message, session: Any) -> None:
            for sql, params in behavior(message):
                await run_step_async(session, sql, params)

        def process(message: Message) -> Result:
            return self.loop.run_until_complete(handle.process(message))

        def process_batch(messages: Sequence[Message], **options: Any) -> list[Result]:
            return self.loop.run_until_complete(handle.process_batch(messages, **options))

        return _Runner(process, process_batch, dedup)

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.dispose())
        self.loop.close()


class AsyncpgFlavor(AsyncFlavor):
    """AsyncDeduplicator on asyncpg (PostgreSQL only): the guard verifies through the server
    what it reads locally on psycopg (consumerdedup.dedup.asyncpg_watch)."""

    def __init__(self, db: Any, claim_first: bool = True) -> None:
        super().__init__(db, claim_first)
        self.loop.run_until_complete(self.engine.dispose())
        self.engine = async_engine(db.url, "asyncpg", pool_size=20, max_overflow=10)


class _Runner:
    def __init__(self, process: Any, process_batch: Any, dedup: Any) -> None:
        self.process = process
        self.process_batch = process_batch
        self.dedup = dedup

    def __call__(self, message: Message) -> Any:
        return self.process(message).outcome

    def batch(self, messages: Sequence[Message]) -> list[Any]:
        return [r.outcome for r in self.process_batch(messages)]
