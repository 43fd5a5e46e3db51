"""Deduplicator: the pipeline on blocking SQLAlchemy sessions."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, overload

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ..breaker import CircuitBreaker
from ..db import before_commit, dialects
from ..message import Message
from ..options import instance
from ..outcome import Outcome, Result
from ..retry import RetryPolicy
from ..schema import DEFAULT, Tables
from .driver_sql import execute, sent_first
from .guard_listeners import guarded_sessionmaker, spend
from .handler_end import after_handler
from .handler_guard import attempt_call, end_calls
from .handler_kinds import check_returned, require_blocking
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
from .transaction_start import begin_checked, release, require_open
from .verified_commit import verified_commit

HandlerFn = Callable[[Message, Session], Any]
BulkHandlerFn = Callable[[list[Message], Session], Any]


_ENGINE = "a sqlalchemy Engine (create_engine); an AsyncEngine goes to AsyncDeduplicator"


class Deduplicator(OutcomeReporter):
    """Runs handlers effectively once per (consumer, message id) on a blocking engine.

    ``@dedup.handler`` wraps ``fn(message, session)``; every write the handler
    makes on ``session`` commits together with the dedup record, or not at all.
    """

    def __init__(
        self,
        engine: Engine,
        consumer: str,
        *,
        tables: Tables = DEFAULT,
        retry: RetryPolicy | None = None,
        dead_letter: Callable[[Result], Any] | None = None,
        observers: Iterable[Observer] = (),
        session_factory: Callable[[], Session] | None = None,
    ) -> None:
        instance(engine, "Deduplicator.engine", Engine, _ENGINE)
        super().__init__(
            engine.dialect.name,
            consumer,
            tables=tables,
            retry=retry,
            dead_letter=dead_letter,
            observers=observers,
            owner="Deduplicator",
        )
        session_factory = self._session_factory(session_factory)
        self.engine = engine
        self.what = f"Deduplicator {consumer!r}"
        dialects.require_transactional(engine, self.what)
        bound = getattr(session_factory, "kw", {}).get("bind")  # a sessionmaker's own engine
        if isinstance(bound, Engine) and bound is not engine:
            dialects.require_transactional(bound, f"{self.what}'s session_factory")
        self.session_factory = session_factory or guarded_sessionmaker(engine)

    @overload
    def handler(self, fn: HandlerFn, /) -> DedupHandler: ...
    @overload
    def handler(
        self, fn: None = None, /, *, claim_first: bool = True
    ) -> Callable[[HandlerFn], DedupHandler]: ...
    def handler(
        self, fn: HandlerFn | None = None, /, *, claim_first: bool = True
    ) -> DedupHandler | Callable[[HandlerFn], DedupHandler]:
        """Wrap ``fn(message, session)``; ``claim_first`` records the key before calling it."""
        if fn is not None:
            return DedupHandler(self, fn, self._claim_first(claim_first))
        claim_first = self._claim_first(claim_first)
        return lambda f: DedupHandler(self, f, claim_first)

    @overload
    def bulk_handler(self, fn: BulkHandlerFn, /) -> BulkDedupHandler: ...
    @overload
    def bulk_handler(self, fn: None = None, /) -> Callable[[BulkHandlerFn], BulkDedupHandler]: ...
    def bulk_handler(
        self, fn: BulkHandlerFn | None = None, /
    ) -> BulkDedupHandler | Callable[[BulkHandlerFn], BulkDedupHandler]:
        """Wrap ``fn(messages, session)``: called once per transaction with its new messages
        (claimed by one multi-row claim; duplicates and twins left out), in delivery order."""
        if fn is not None:
            return BulkDedupHandler(self, fn)
        return lambda f: BulkDedupHandler(self, f)


class DedupHandler:
    """A wrapped handler: call it with a Message, get an Outcome."""

    def __init__(self, dedup: Deduplicator, fn: HandlerFn, claim_first: bool) -> None:
        require_blocking(fn)
        self.dedup = dedup
        self.fn = fn
        self._pipeline: Pipeline = dedup._pipeline(claim_first)
        self.__wrapped__ = fn
        self.__doc__ = fn.__doc__

    def __call__(self, message: Message) -> Outcome:
        return self.process(message).outcome

    def batch(self, messages: Sequence[Message]) -> list[Outcome]:
        """One transaction for many messages; one Outcome per message, in order."""
        return [result.outcome for result in self.process_batch(messages)]

    def process(self, message: Message) -> Result:
        return self.process_batch([message])[0]

    def process_batch(self, messages: Sequence[Message], *, ordered: bool = False) -> list[Result]:
        """One Result per message, in order. ``ordered``: the messages come from an ordered
        source (a Kafka partition): nothing commits behind a message that is to be retried."""
        return self.process_deliveries(messages, ordered=ordered)

    def process_deliveries(
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
                time.sleep(report.wait)
            report = self._attempt(batch)
        return [self._settle(result) for result in self._pipeline.finish(batch)]

    def _attempt(self, batch: Batch) -> AttemptReport:
        with self.dedup.session_factory() as session:
            before_commit.open_queue(session, self.dedup.what)  # outbox keys: at COMMIT
            try:
                return self._drive(self._pipeline.attempt(batch), session)
            finally:  # a reused session (scoped_session) must not hold writes back later
                before_commit.discard(session)
                release(session)
                spend(session)

    def _drive(self, attempt: Attempt, session: Session) -> AttemptReport:
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
                    begin_checked(session, self.dedup.what, pipelined=sent_first(op))
                reply = self._carry_out(op, session)
            except Exception as exc:
                error = exc
                if isinstance(op, CallHandler | CallBulk):  # its claims may be committed
                    error = after_handler(session, exc)

    def _carry_out(self, op: Op, session: Session) -> Any:
        match op:
            case Execute(statement, params, read):
                return read(execute(session, statement, params))
            case CallHandler(message):
                return self._call(message, session)
            case Commit():
                before_commit.flush(session)  # still guarded: refused if it ended
                require_open(session, end_calls(session))
                with verified_commit(session):  # the server's answer, not the driver's word
                    return session.commit()
            case Rollback():
                before_commit.discard(session)
                release(session)
                return session.rollback()

    def _call(self, message: Message, session: Session) -> None:
        self._guarded(self.fn, message, session)

    def _guarded(self, fn: Any, argument: Any, session: Session) -> None:
        """One call of a handler function under the guard (a message, or a bulk's list)."""
        call = attempt_call(session)
        try:
            with handler_code():
                returned = fn(argument, session)
            check_returned(fn, returned)  # outside handler_code: a setup fault
            with handler_code():
                session.flush()  # a pending ORM write fails now, charged to this call
        finally:
            call.finish()
        call.verify()

    def _settle(self, result: Result) -> Result:
        if result.outcome is Outcome.FAILED and self.dedup.dead_letter is not None:
            try:
                self.dedup.dead_letter(result)
            except Exception as exc:
                result = self.dedup._dead_letter_failed(result, exc)
        self.dedup._account(result)
        return result


class BulkDedupHandler(DedupHandler):
    """What ``@dedup.bulk_handler`` returns: a DedupHandler (every runner takes it) whose
    function is called once per transaction with that transaction's new messages; a failure
    is charged to the message the handler names, else bisected (dedup/bulk.py)."""

    def __init__(self, dedup: Deduplicator, fn: BulkHandlerFn) -> None:
        require_blocking(fn)
        super().__init__(dedup, functools.partial(_one_message, fn), claim_first=True)
        self.bulk_fn = fn
        self._pipeline = dedup._bulk_pipeline()
        self.__wrapped__ = fn  # type: ignore[assignment]  # the bulk function, not the adapter
        self.__doc__ = fn.__doc__

    def _carry_out(self, op: Op, session: Session) -> Any:
        if isinstance(op, CallBulk):
            return self._call_bulk(list(op.messages), session)
        return super()._carry_out(op, session)

    def _call_bulk(self, messages: list[Message], session: Session) -> None:
        self._guarded(self.bulk_fn, messages, session)


def _one_message(fn: BulkHandlerFn, message: Message, session: Session) -> Any:
    return fn([message], session)
