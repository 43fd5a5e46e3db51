"""A bulk handler over the ledger, for either deduplicator: the bulk tests' one helper.

The handler records each call's ids, lets the test's ``fail(messages)`` raise,
then writes one ledger row per message with a single executemany INSERT.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import text

from consumerdedup import AsyncDeduplicator, Deduplicator, Message, Result, RetryPolicy
from tests.conftest import Database

QUICK = RetryPolicy(attempts=2, initial_delay=timedelta(0), max_delay=timedelta(0))
Fail = Callable[[list[Message], Any], Any]


def never(messages: list[Message], session: Any) -> None:
    """The default ``fail``: every call succeeds."""


class BulkLedger:
    """A ledger table and bulk handlers over it, blocking (``sync``) or asyncio."""

    def __init__(self, db: Database, kind: str) -> None:
        self.db = db
        self.kind = kind
        self.table = db.create_ledger()
        self.calls: list[list[str]] = []
        self._loop = asyncio.new_event_loop() if kind == "async" else None
        self._engine = db.async_engine() if kind == "async" else None

    def handler(
        self, fail: Fail = never, *, consumer: str = "bulk", retry: RetryPolicy = QUICK
    ) -> Callable[..., list[Result]]:
        """``process_batch`` of a fresh bulk handler, callable from blocking code."""
        insert = text(f"INSERT INTO {self.table} (account, amount, message_id) VALUES ('a', 1, :m)")
        options: dict[str, Any] = {"consumer": consumer, "tables": self.db.tables, "retry": retry}
        if self._engine is None:
            dedup = Deduplicator(self.db.engine, **options)

            @dedup.bulk_handler
            def handle(messages: list[Message], session: Any) -> None:
                self.calls.append([m.id for m in messages])
                fail(messages, session)
                session.execute(insert, [{"m": m.id} for m in messages])

            return handle.process_batch
        async_dedup = AsyncDeduplicator(self._engine, **options)

        @async_dedup.bulk_handler
        async def handle_async(messages: list[Message], session: Any) -> None:
            self.calls.append([m.id for m in messages])
            failing = fail(messages, session)
            if inspect.isawaitable(failing):  # a ``fail`` that uses the AsyncSession
                await failing
            await session.execute(insert, [{"m": m.id} for m in messages])

        def process_batch(messages: Sequence[Message], **kw: Any) -> list[Result]:
            assert self._loop is not None
            return self._loop.run_until_complete(handle_async.process_batch(messages, **kw))

        return process_batch

    def applied(self) -> list[str]:
        with self.db.engine.connect() as conn:
            rows = conn.exec_driver_sql(f"SELECT message_id FROM {self.table}")
            return sorted(r[0] for r in rows)

    def recorded(self, consumer: str = "bulk") -> dict[str, str]:
        """message_id -> outcome in processed_events, for ``consumer``."""
        pe = self.db.tables.processed_events
        with self.db.engine.connect() as conn:
            query = pe.select().where(pe.c.consumer == consumer)
            return {row.message_id: row.outcome for row in conn.execute(query)}

    def close(self) -> None:
        if self._loop is not None and self._engine is not None:
            self._loop.run_until_complete(self._engine.dispose())
            self._loop.close()


def messages(count: int, prefix: str = "m-") -> list[Message]:
    return [Message(id=f"{prefix}{n:02d}", body=b"{}") for n in range(count)]


def poisoned(ids: set[str], error: Callable[[str], Exception]) -> Fail:
    """A ``fail`` that raises ``error(id)`` when a call holds any of ``ids``."""

    def fail(batch: list[Message], session: Any) -> None:
        for message in batch:
            if message.id in ids:
                raise error(message.id)

    return fail
