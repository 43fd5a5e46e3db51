"""AsyncDeduplicator: the same pipeline, awaited, on SQLAlchemy's AsyncSession."""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, overload

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from ..breaker import CircuitBreaker
from ..db import before_commit, dialects
from ..message import Message
from ..options import instance
from ..outcome import Outcome, Result
from ..retry import RetryPolicy
from ..schema import DEFAULT, Tables
from .driver_sql import execute_async, sent_first
from .guard_listeners import guarded_async_sessionmaker, spend
from .handler_end import after_handler
from .handler_guard import attempt_call, end_calls, pending_writes
from .handler_kinds import check_awaitable, check_awaited, require_async
from .offset_fence import OffsetFence
from .ops import (
    Attempt,
    AttemptReport,
    CallBulk,
    CallHandler,
    Commit,
    Execute,
    Op,
    Rollback,
    handler_code,
)
from .pipeline import Delivered, Pipeline
from .settings import Observer, OutcomeReporter
from .states import Batch
from .transaction_start import begin_checked, release_async, require_open
from .verified_commit import verified_commit

AsyncHandlerFn = Callable[[Message, AsyncSession], Awaitable[Any]]
AsyncBulkHandlerFn = Callable[[list[Message], AsyncSession], Awaitable[Any]]


_ENGINE = "a sqlalchemy AsyncEngine (create_async_engine); an Engine goes to Deduplicator"


class AsyncDeduplicator(OutcomeReporter):
    """Deduplicator for asyncio: ``@dedup.handler`` wraps ``async fn(message, session)``.

    ``dead_letter`` may be a plain function or a coroutine function.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        consumer: str,
        *,
        tables: Tables = DEFAULT,
        retry: RetryPolicy | None = None,
        dead_letter: Callable[[Result], Any] | None = None,
        observers: Iterable[Observer] = (),
        session_factory: Callable[[], AsyncSession] | None = None,
    ) -> None:
        instance(engine, "AsyncDeduplicator.engine", AsyncEngine, _ENGINE)
        super().__init__(
            engine.dialect.name,
            consumer,
            tables=tables,
            retry=retry,
            dead_letter=dead_letter,
            observers=observers,
            owner="AsyncDeduplicator",
        )
        session_factory = self._session_factory(session_factory)
        self.engine = engine
        self.what = f"AsyncDeduplicator {consumer!r}"
        dialects.require_transactional(engine.sync_engine, self.what)
        bound = getattr(session_factory, "kw", {}).get("bind")  # an async_sessionmaker's engine
        if isinstance(bound, AsyncEngine) and bound is not engine:
            dialects.require_transactional(bound.sync_engine, f"{self.what}'s session_factory")
        self.session_factory = session_factory or guarded_async_sessionmaker(engine)

    @overload
    def handler(self, fn: AsyncHandlerFn, /) -> AsyncDedupHandler: ...
    @overload
    def handler(
        self, fn: None = None, /, *, claim_first: bool = True
    ) -> Callable[[AsyncHandlerFn], AsyncDedupHandler]: ...
    def handler(
        self, fn: AsyncHandlerFn | None = None, /, *, claim_first: bool = True
    ) -> AsyncDedupHandler | Callable[[AsyncHandlerFn], AsyncDedupHandler]:
        """Wrap ``async fn(message, session)``; ``claim_first`` records the key first."""
        if fn is not None:
            return AsyncDedupHandler(self, fn, self._claim_first(claim_first))
        claim_first = self._claim_first(claim_first)
        return lambda f: AsyncDedupHandler(self, f, claim_first)

    @overload
    def bulk_handler(self, fn: AsyncBulkHandlerFn, /) -> AsyncBulkDedupHandler: ...
    @overload
    def bulk_handler(
        self, fn: None = None, /
    ) -> Callable[[AsyncBulkHandlerFn], AsyncBulkDedupHandler]: ...
    def bulk_handler(
        self, fn: AsyncBulkHandlerFn | None = None, /
    ) -> AsyncBulkDedupHandler | Callable[[AsyncBulkHandlerFn], AsyncBulkDedupHandler]:
        """Wrap ``async fn(messages, session)``: ``Deduplicator.bulk_handler`` for asyncio."""
        if fn is not None:
            return AsyncBulkDedupHandler(self, fn)
        return lambda f: AsyncBulkDedupHandler(self, f)


class AsyncDedupHandler:
    """A wrapped coroutine handler: ``await handler(message)`` gives an Outcome."""

    def __init__(self, dedup: AsyncDeduplicator, fn: AsyncHandlerFn, claim_first: bool) -> None:
        require_async(fn)
        self.dedup = dedup
        self.fn = fn
        self._pipeline: Pipeline = dedup._pipeline(claim_first)
        self.__wrapped__ = fn
        self.__doc__ = fn.__doc__

    async def __call__(self, message: Message) -> Outcome:
        return (await self.process(message)).outcome

    async def batch(self, messages: Sequence[Message]) -> list[Outcome]:
        """One transaction for many messages; one Outcome per message, in order."""
        return [result.outcome for result in await self.process_batch(messages)]

    async def process(self, message: Message) -> Result:
        return (await self.process_batch([message]))[0]

    async def process_batch(
        self, messages: Sequence[Message], *, ordered: bool = False
    ) -> list[Result]:
        """One Result per message, in order. ``ordered``: the messages come from an ordered
        source (a Kafka partition): nothing commits behind a message that is to be retried."""
        return await self.process_deliveries(messages, ordered=ordered)

    async def process_deliveries(
        self,
        delivered: Sequence[Message | Delivered],
        *,
        ordered: bool = False,
        breaker: CircuitBreaker | None = None,
        fence: OffsetFence | None = None,
    ) -> list[Result]:
        """``process_batch`` for a runner: each delivery may come with why the runner refuses
        it (FAILED with that reason, dead-lettered in its place, held back behind a RETRY);
        ``breaker``: the runner's circuit breaker (once open, the rest ends RETRY);
        ``fence``: the source's offset, written in the batch's transactions (offset_fence)."""
        batch = self._pipeline.start(delivered, ordered, breaker, fence)
        report = AttemptReport(pending=bool(batch.items))
        while report.pending:  # the pipeline decides each next attempt and its wait
            if report.wait:
                await asyncio.sleep(report.wait)
            report = await self._attempt(batch)
        results = self._pipeline.finish(batch)
        if self.dedup.dead_letter is None:  # nothing to await: no coroutine per message
            self.dedup._account_all(results)
            return results
        return [await self._settle(result) for result in results]

    async def _attempt(self, batch: Batch) -> AttemptReport:
        async with self.dedup.session_factory() as session:
            before_commit.open_queue(session, self.dedup.what)  # outbox keys: at COMMIT
            try:
                return await self._drive(self._pipeline.attempt(batch), session)
            finally:  # a reused session (scoped_session) must not hold writes back later
                before_commit.discard(session)
                await release_async(session.sync_session)
                spend(session.sync_session)

    async def _drive(self, attempt: Attempt, session: AsyncSession) -> AttemptReport:
        reply: Any = None
        error: Exception | None = None
        begin = True
        while True:
            try:
                op = attempt.send(reply) if error is None else attempt.throw(error)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            reply, error = None, None
            try:
                if begin:  # however the session was made; a failure here is the first op's
                    begin = False
                    await session.run_sync(begin_checked, self.dedup.what, sent_first(op))
                reply = await self._carry_out(op, session)
            except Exception as exc:
                error = exc
                if isinstance(op, CallHandler | CallBulk):  # its claims may be committed
                    error = after_handler(session.sync_session, exc)

    async def _carry_out(self, op: Op, session: AsyncSession) -> Any:
        match op:
            case Execute(statement, params, read):
                return read(await execute_async(session, statement, params))
            case CallHandler(message):
                return await self._call(message, session)
            case Commit():
                await before_commit.flush_async(session)  # still guarded: refused if it ended
                require_open(session.sync_session, end_calls(session.sync_session))
                with verified_commit(session.sync_session):  # the server's answer
                    return await session.commit()
            case Rollback():
                before_commit.discard(session)
                await release_async(session.sync_session)
                return await session.rollback()

    async def _call(self, message: Message, session: AsyncSession) -> None:
        await self._guarded(self.fn, message, session)

    async def _guarded(self, fn: Any, argument: Any, session: AsyncSession) -> None:
        """One call of a handler function under the guard (a message, or a bulk's list)."""
        # Our statement has run in this transaction: its connection is there, no await needed.
        call = attempt_call(session.sync_session)
        try:
            with handler_code():
                returned = fn(argument, session)
            check_awaitable(fn, returned)  # outside handler_code: a setup fault
            with handler_code():
                result = await returned
            check_awaited(fn, result)
            if pending_writes(session.sync_session):  # else a flush only costs a greenlet
                with handler_code():
                    await session.flush()  # a pending ORM write fails now, charged to this call
        finally:
            call.finish()
        await call.probe()  # asyncpg: the server says whether a swallowed error aborted it
        call.verify()

    async def _settle(self, result: Result) -> Result:
        if result.outcome is Outcome.FAILED and self.dedup.dead_letter is not None:
            try:
                told = self.dedup.dead_letter(result)
                if inspect.isawaitable(told):
                    await told
            except Exception as exc:
                result = self.dedup._dead_letter_failed(result, exc)
        self.dedup._account(result)
        return result


class AsyncBulkDedupHandler(AsyncDedupHandler):
    """What ``AsyncDeduplicator.bulk_handler`` returns: ``BulkDedupHandler``, awaited."""

    def __init__(self, dedup: AsyncDeduplicator, fn: AsyncBulkHandlerFn) -> None:
        require_async(fn)
        super().__init__(dedup, functools.partial(_one_message, fn), claim_first=True)
        self.bulk_fn = fn
        self._pipeline = dedup._bulk_pipeline()
        self.__wrapped__ = fn  # type: ignore[assignment]  # the bulk function, not the adapter
        self.__doc__ = fn.__doc__

    async def _carry_out(self, op: Op, session: AsyncSession) -> Any:
        if isinstance(op, CallBulk):
            return await self._call_bulk(list(op.messages), session)
        return await super()._carry_out(op, session)

    async def _call_bulk(self, messages: list[Message], session: AsyncSession) -> None:
        await self._guarded(self.bulk_fn, messages, session)


async def _one_message(fn: AsyncBulkHandlerFn, message: Message, session: AsyncSession) -> Any:
    return await fn([message], session)
