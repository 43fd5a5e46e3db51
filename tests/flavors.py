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

Behavior = Callable[[Message], Sequence[tuple[str, dict[str, Any]]]]


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
                session.execute(text(sql), params)

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
                await session.execute(text(sql), params)

        def process(message: Message) -> Result:
            return self.loop.run_until_complete(handle.process(message))

        def process_batch(messages: Sequence[Message]) -> list[Result]:
            return self.loop.run_until_complete(handle.process_batch(messages))

        return _Runner(process, process_batch, dedup)

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.dispose())
        self.loop.close()


class _Runner:
    def __init__(self, process: Any, process_batch: Any, dedup: Any) -> None:
        self.process = process
        self.process_batch = process_batch
        self.dedup = dedup

    def __call__(self, message: Message) -> Any:
        return self.process(message).outcome

    def batch(self, messages: Sequence[Message]) -> list[Any]:
        return [r.outcome for r in self.process_batch(messages)]
