"""The one decision logic of the pipeline, as a generator.

The logic never touches a database itself. It yields operations (run this
statement, call the handler, commit, roll back) and the sync and async
drivers carry them out, sending results back or throwing errors in. So the
blocking and the asyncio deduplicators share every decision, statement and
error rule, and differ only in whether they ``await``.

A batch goes one way, from the runner to the commit::

    start(deliveries)  refused deliveries FAILED, one Item per key (states.py)
    attempt(batch)     one transaction over the next span, as often as reported
    finish(batch)      one Result per delivery, in order

An attempt is claim-first (claim the keys, look up the others, handle, write
the FAILED records, commit) or check-first (look up the keys, handle, write
every record, commit). A failure moves the item it is charged to by the table
in states.py; ``failures.carry`` says which failure an error is.

A handler that ended the transaction below every guard (a COMMIT through libpq
itself, or a cursor class made by hand: handler_guard) may have committed the
attempt's claims as PROCESSED before its writes. The driver says so when it
reads the transaction over after the call (handler_end: HandlerFailed.ended),
and before anything else happens to the batch (a retry, a bisection, a FAILED
record) those claims are deleted in a transaction of their own: exactly the
rows the attempt's claim wrote (statements.unclaims), so its keys are claimable
again and no redelivery finds them done without their effects. If that fails
too, the claimed messages end FAILED (ClaimNotUndone), dead-lettered rather
than lost behind their record. What this does not cover: check-first has no
claims to undo (the handler's writes that such a COMMIT committed stay, and a
retry applies them again); the writes any such COMMIT committed stay committed
(a retry may apply them twice: at least once, not exactly once); a process that
dies between the handler's COMMIT and the repair leaves the claims PROCESSED,
and a twin delivery in that window answers DUPLICATE.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Sequence
from datetime import datetime
from typing import Any

from ..errors import ConfigurationError, InvalidMessage, RetryLater
from ..message import Message, payload_hash, validate_id
from ..observe import logger
from ..outcome import Outcome, Result
from ..reasons import describe
from ..retry import ErrorKind, RetryPolicy
from ..schema import utcnow
from .failures import (
    ClaimNotUndone,
    HandlerFailed,
    StatementRefused,
    TransactionFailed,
    carry,
    signature,
)
from .ops import Attempt, AttemptReport, CallHandler, Commit, Op, Rollback
from .records import Records
from .statements import Statements
from .states import Batch, Item, Next, State, next_after

Delivered = tuple[Message, str | None]
"""A delivery's Message, and why the runner refuses it (None: it does not)."""


class Pipeline:
    """Per-consumer settings plus the decision logic over a batch of messages.

    A transaction covers a *span*: the undecided items from the first one on,
    in order. The first span is the whole batch (one claim, the handlers back
    to back, one commit). A failure is isolated without savepoints, so that a
    commit-time error is isolated like any other and order is kept: when a
    handler fails, the items before it commit first, then it runs alone; when
    a statement or the COMMIT fails with no message to blame, the span is
    halved until one is.
    """

    def __init__(
        self, statements: Statements, consumer: str, policy: RetryPolicy, claim_first: bool
    ) -> None:
        self.records = Records(statements, consumer)
        self.consumer = consumer
        self.policy = policy
        self.claim_first = claim_first
        self.backoff = policy.backoff()

    def start(self, deliveries: Sequence[Message | Delivered], ordered: bool = False) -> Batch:
        """One slot per delivery, one Item per key; later copies of a key follow the first.

        A delivery the runner refuses, or whose id cannot be a key, is decided here:
        FAILED with InvalidMessage, nothing recorded (it has no usable key).
        """
        slots: list[Result | Item] = []
        leaders: dict[str, Item] = {}
        for delivered in deliveries:
            message, why = delivered if isinstance(delivered, tuple) else (delivered, None)
            try:
                if why is not None:
                    raise InvalidMessage(why)
                item = Item(message, validate_id(message.id), payload_hash(message.body))
            except InvalidMessage as exc:
                slots.append(Result(message, Outcome.FAILED, exc))
                continue
            leader = leaders.setdefault(item.key, item)
            if leader is not item:
                leader.followers.append(item)
            slots.append(item)
        return Batch(slots, list(leaders.values()), ordered)

    def attempt(self, batch: Batch) -> Attempt:
        """One transaction over the next span of undecided items; decides every item it can."""
        span = self._span(batch)
        try:
            if self.claim_first:
                return (yield from self._claim_first(batch, span))
            return (yield from self._check_first(batch, span))
        except TransactionFailed as failed:  # nothing of the transaction stands
            return self._transaction_failed(batch, span, failed.error)

    def _claim_first(self, batch: Batch, span: list[Item]) -> Attempt:
        """Claim the keys (a twin then waits on them), look up the rest, handle, commit."""
        runnable = [item for item in span if item.state is not State.FAILING]
        stamp = utcnow()  # the claim's rows carry it: what undoes them matches it
        claimed = yield from self.records.write(runnable, [], now=stamp)
        unknown = yield from self.records.look_up([i for i in span if i.key not in claimed])
        # A key neither claimed nor recorded was committed by a twin in between; it stays
        # undecided and the next attempt looks again. On an ordered source nothing behind
        # it may commit first: the whole span waits.
        if batch.ordered and any(item.state is not State.FAILING for item in unknown):
            yield from carry(Rollback())
            return self._report(batch, backoff=False)
        fresh = [item for item in runnable if item.key in claimed]
        culprit = yield from self._handle(fresh, stamp)
        if culprit is not None:
            return self._handler_failed(batch, span, *culprit)
        failing = [item for item in span if item.state is State.FAILING]
        return (yield from self._commit(batch, fresh, [], failing))

    def _check_first(self, batch: Batch, span: list[Item]) -> Attempt:
        """Look the keys up, handle the unknown ones, write every record last, commit."""
        unknown = yield from self.records.look_up(span)
        fresh = [item for item in unknown if item.state is not State.FAILING]
        culprit = yield from self._handle(fresh, None)
        if culprit is not None:
            return self._handler_failed(batch, span, *culprit)
        failing = [item for item in unknown if item.state is State.FAILING]
        return (yield from self._commit(batch, fresh, fresh, failing))

    def _handle(
        self, items: Sequence[Item], claimed_at: datetime | None
    ) -> Generator[Op, Any, tuple[Item, Exception] | None]:
        """Each item's handler in turn; at the first that fails, roll back: it and its error.

        ``claimed_at``: the items' claims were written at that stamp (claim-first), else None.
        """
        for item in items:
            try:
                yield from carry(CallHandler(item.message))
            except HandlerFailed as failed:
                yield from self._rolled_back(failed, items, claimed_at)
                return item, failed.error
        return None

    def _rolled_back(
        self, failed: HandlerFailed, claimed: Sequence[Item], claimed_at: datetime | None
    ) -> Generator[Op, Any, None]:
        """Roll back after a failed handler call; if the driver found the transaction
        ended, undo the claims it may have committed (``_unclaim``) before anything else."""
        if not failed.ended or claimed_at is None or not claimed:
            yield from carry(Rollback())
            if failed.setup:
                raise failed.error
            return
        broken: TransactionFailed | None = None
        try:
            yield from carry(Rollback())
        except TransactionFailed as exc:  # the repair is tried all the same, then this
            broken = exc
        yield from self._unclaim(claimed, claimed_at)
        if failed.setup:
            raise failed.error
        if broken is not None:
            raise broken

    def _unclaim(self, claimed: Sequence[Item], claimed_at: datetime) -> Generator[Op, Any, None]:
        """In a transaction of its own, DELETE the claims ``claimed`` made at ``claimed_at``;
        if that fails, they end FAILED (ClaimNotUndone) rather than stay done unseen."""
        try:
            removed = yield from self.records.unclaim(claimed, claimed_at)
            yield from carry(Commit())
        except (TransactionFailed, ConfigurationError) as exc:
            cause = exc.error if isinstance(exc, TransactionFailed) else exc
            with contextlib.suppress(TransactionFailed, ConfigurationError):
                yield from carry(Rollback())  # failing, the connection is gone with it
            why = ClaimNotUndone(
                "the handler ended the transaction, which may have committed its claim as "
                f"processed, and undoing the claim failed ({describe(cause)}): forget the "
                "key before replaying the message"
            )
            why.__cause__ = cause
            logger.error("%d claims may stand without their work: %s", len(claimed), why)
            for item in claimed:
                if item.state is not State.DECIDED:
                    item.decide(Outcome.FAILED, why)
            return
        if removed:
            logger.warning(
                "the handler ended the transaction and committed %d claims: deleted", removed
            )

    def _commit(
        self, batch: Batch, handled: list[Item], ours: list[Item], failing: list[Item]
    ) -> Attempt:
        """Write ``ours`` PROCESSED and ``failing`` FAILED, then COMMIT the handlers' work."""
        written = yield from self.records.write(ours, failing, after_handlers=bool(handled))
        if len(written) < len(ours) + len(failing):
            # A twin committed one of these keys meanwhile: undo all, let the lookup decide.
            yield from carry(Rollback())
            return self._report(batch, backoff=False)
        yield from carry(Commit())
        for item in handled:
            item.decide(Outcome.PROCESSED)
        for item in failing:
            item.decide(Outcome.FAILED, item.failure)
        if batch.limit is not None:  # grow back after a culprit was passed, halving found it
            batch.limit *= 2
        return self._report(batch, backoff=False)

    @staticmethod
    def _span(batch: Batch) -> list[Item]:
        """The undecided items from the first one on; an item ALONE runs alone."""
        span: list[Item] = []
        for item in batch.undecided():
            alone = item.state is State.ALONE
            if alone and span:
                break
            span.append(item)
            if alone or (batch.limit is not None and len(span) >= batch.limit):
                break
        return span

    def _handler_failed(
        self, batch: Batch, span: Sequence[Item], culprit: Item, exc: Exception
    ) -> AttemptReport:
        """The culprit runs alone from now on; what precedes it commits first, without waiting."""
        if culprit.state is State.DECIDED:  # its claim could not be undone (ClaimNotUndone)
            return self._report(batch, backoff=False)
        transient = self.policy.classify(exc) is ErrorKind.TRANSIENT
        if transient and signature(exc) in batch.spent:
            self._give_up(batch, [culprit], exc)
            return self._report(batch, backoff=False)
        self._charge(batch, culprit, exc, alone=True)
        before = span[: span.index(culprit)]
        first = all(item.state is State.DECIDED for item in before)
        return self._report(batch, backoff=first and culprit.state is not State.FAILING)

    def _transaction_failed(
        self, batch: Batch, span: Sequence[Item], exc: Exception
    ) -> AttemptReport:
        """A statement of ours or the COMMIT failed: a transient error charges every item of
        the span (or an unreachable database would be retried forever); any other error
        halves the span until it names its culprit (a deferred constraint fails at COMMIT)."""
        undecided = [item for item in span if item.state is not State.DECIDED]
        refused = isinstance(exc, StatementRefused)
        exc = exc.error if isinstance(exc, StatementRefused) else exc
        transient = self.policy.classify(exc) is ErrorKind.TRANSIENT
        # A statement of ours the driver refused without a code (psycopg's "number of
        # parameters must be between 0 and 65535"): retried as is it would fail forever.
        if len(undecided) > 1 and (refused or not transient):
            batch.limit = len(undecided) // 2
            return self._report(batch, backoff=False)
        # Our statement or the COMMIT: the database itself is failing, every item alike.
        if transient and batch.spent and undecided:
            self._give_up(batch, undecided, exc)
            return self._report(batch, backoff=False)
        for item in undecided:
            self._charge(batch, item, exc, alone=len(undecided) == 1)
        return self._report(batch, backoff=True)

    def _charge(self, batch: Batch, item: Item, exc: BaseException, alone: bool) -> None:
        """One more failed try of ``item``: it moves by the table (states.ON_FAILURE)."""
        item.attempts += 1
        kind = self.policy.classify(exc)
        exhausted = item.attempts >= self.policy.attempts
        if exhausted and kind is ErrorKind.TRANSIENT:
            batch.spent.setdefault(signature(exc), item.key)
        match next_after(kind, item.state is State.FAILING, exhausted):
            case Next.AGAIN if alone and item.state is State.NEW:
                item.state = State.ALONE
            case Next.FAILING:
                item.fail(exc)
            case Next.RETRY:
                item.decide(Outcome.RETRY, exc)
            case Next.UNRECORDED:
                logger.error("FAILED %r could not be recorded: %s", item.key, describe(exc))
                item.decide(Outcome.FAILED, item.failure)

    @staticmethod
    def _give_up(batch: Batch, failed: Sequence[Item], exc: Exception) -> None:
        """A transient failure again after one used up a message's attempts: the ``failed``
        items end RETRY with it, and every undecided item behind the first of them ends
        RETRY untried. What precedes them is left to commit."""
        spent = batch.spent.get(signature(exc)) or next(iter(batch.spent.values()))
        why = RetryLater(
            f"not tried: {describe(exc)} already used up the attempts of {spent!r} in this batch"
        )
        for item in failed:
            item.attempts += 1
            item.decide(Outcome.RETRY, exc)
        for item in batch.items[batch.items.index(failed[0]) + 1 :]:
            if item.state is not State.DECIDED:
                item.decide(Outcome.RETRY, why)

    def _report(self, batch: Batch, backoff: bool) -> AttemptReport:
        """What the driver does next: attempt again (after a wait) or finish."""
        batch.rounds += 1
        batch.over_budget(self.policy.attempts)
        if batch.ordered:
            batch.hold_back()
        pending = bool(batch.undecided())
        wait = self.backoff.delay(batch.rounds) if pending and backoff else 0.0
        return AttemptReport(pending=pending, wait=wait)

    @staticmethod
    def finish(batch: Batch) -> list[Result]:
        """One Result per delivery, in the order given (``Batch.results``)."""
        return batch.results()
