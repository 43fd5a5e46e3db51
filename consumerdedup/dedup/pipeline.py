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

from ..breaker import CircuitBreaker
from ..errors import ConfigurationError, InvalidMessage, RetryLater, TransactionBroken
from ..message import Message, payload_hash, validate_id
from ..observe import logger
from ..outcome import Outcome, Result
from ..reasons import describe
from ..retry import ErrorKind, RetryPolicy
from ..schema import utcnow
from .attempt_log import AttemptLog
from .failures import (
    ClaimNotUndone,
    HandlerFailed,
    StatementRefused,
    TransactionFailed,
    carry,
    signature,
)
from .offset_fence import OffsetFence, PartitionFenced
from .ops import Attempt, AttemptReport, CallHandler, Commit, Execute, Op, Rollback
from .records import Records
from .statements import Statements
from .states import Batch, Item, Next, State, decide_processed, next_after

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
        if statements.mysql and not claim_first:
            raise ConfigurationError(
                "claim_first=False on MySQL/MariaDB: InnoDB can roll a transaction back whole "
                "(a deadlock) and let the next statement open a new one, and only a claim row "
                "written first can prove before COMMIT that the transaction is still ours; "
                "use claim-first (the default) there (docs/databases.md)"
            )
        self.records = Records(statements, consumer)
        self.consumer = consumer
        self.policy = policy
        self.claim_first = claim_first
        self.backoff = policy.backoff()
        self.attempt_log = AttemptLog(consumer, policy.attempts)

    def start(
        self,
        deliveries: Sequence[Message | Delivered],
        ordered: bool = False,
        breaker: CircuitBreaker | None = None,
        fence: OffsetFence | None = None,
    ) -> Batch:
        """One slot per delivery, one Item per key; later copies of a key follow the first.

        A delivery the runner refuses, or whose id cannot be a key, is decided here:
        FAILED with InvalidMessage, nothing recorded (it has no usable key). ``breaker``:
        the runner's circuit breaker (breaker.py), told of every handler's FAILED and
        PROCESSED; once it is open, what is not tried yet ends RETRY (``_halt``). ``fence``:
        the source's position, written in each of the batch's transactions (offset_fence).
        """
        slots: list[Result | Item] = []
        leaders: dict[str, Item] = {}
        refused = 0
        for delivered in deliveries:
            message, why = delivered if isinstance(delivered, tuple) else (delivered, None)
            try:
                if why is not None:
                    raise InvalidMessage(why)
                key = validate_id(message.id)
                body = message.body
                # An immutable bytes body is hashed when needed (Item.hash); any other is
                # hashed now, so a body that cannot be one is refused here as before.
                item = Item(message, key, None if type(body) is bytes else payload_hash(body))
            except InvalidMessage as exc:
                slots.append(Result(message, Outcome.FAILED, exc))
                refused += 1
                continue
            leader = leaders.setdefault(item.key, item)
            if leader is not item:
                if leader.followers is None:
                    leader.followers = []
                leader.followers.append(item)
            slots.append(item)
        items = list(leaders.values())
        twins = len(items) + refused < len(slots)
        return Batch(slots, items, ordered, breaker=breaker, fence=fence, twins=twins)

    def attempt(self, batch: Batch) -> Attempt:
        """One transaction over the next span of undecided items; decides every item it can."""
        if batch.breaker is not None and batch.breaker.open:
            self._halt(batch)  # opened meanwhile (another partition's batch, or this one's)
            if not batch.undecided():
                return self._report(batch)
        span = self._span(batch)
        try:
            if batch.fence is not None and not batch.fence.claims:
                if not batch.twins:
                    return (yield from self._by_offset(batch, span))
                # A key twice in the chunk: claimed, so that the copies answered DUPLICATE
                # or PayloadMismatch here are answered so from the record if read again.
                batch.fence.claims = True
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
            return self._report(batch)
        fresh = [item for item in runnable if item.key in claimed]
        culprit = yield from self._handle(fresh, stamp)
        if culprit is not None:
            return self._handler_failed(batch, span, *culprit)
        failing = [item for item in span if item.state is State.FAILING]
        return (yield from self._commit(batch, fresh, [], failing, claimed_at=stamp))

    def _check_first(self, batch: Batch, span: list[Item]) -> Attempt:
        """Look the keys up, handle the unknown ones, write every record last, commit."""
        unknown = yield from self.records.look_up(span)
        fresh = [item for item in unknown if item.state is not State.FAILING]
        culprit = yield from self._handle(fresh, None)
        if culprit is not None:
            return self._handler_failed(batch, span, *culprit)
        failing = [item for item in unknown if item.state is State.FAILING]
        return (yield from self._commit(batch, fresh, fresh, failing))

    def _by_offset(self, batch: Batch, span: list[Item]) -> Attempt:
        """The source's offset alone decides (OffsetFence.claims False): no claim, no
        lookup: read the owner epoch (fenced already: nothing is handled), handle, write the
        FAILED records and the offset, commit."""
        fence = batch.fence
        assert fence is not None
        if fence.statements.begin is not None:  # MySQL: a SELECT alone opens no transaction
            yield from carry(Execute(fence.statements.begin, {}, _nothing))
        read = Execute(fence.statements.epoch_in_batch, fence.key(), fence.read_epoch)
        if (yield from carry(read)) != fence.epoch:
            yield from carry(Rollback())
            self._fenced(batch, fence)
            return self._report(batch)
        if fence.recheck and span and span[0] is batch.items[0]:  # below recheck_until
            # The whole batch, not the span: after a failed lookup halved it, the rest
            # would go unlooked-up once the first half's answered.
            undecided = batch.undecided()
            unknown = yield from self.records.look_up(undecided)
            fence.recheck = False  # answered: a lookup that failed is tried again
            if len(unknown) < len(undecided):
                # Recorded ones (decided by the lookup): a FAILED record held for its dead
                # letter and those applied behind it, or copies of a key its chunk claimed
                # (a twin behind a RETRY). The rest goes as with claims.
                fence.claims = True
                return (yield from self._claim_first(batch, self._span(batch)))
        runnable = [item for item in span if item.state is not State.FAILING]
        culprit = yield from self._handle(runnable, None)
        if culprit is not None:
            return self._handler_failed(batch, span, *culprit)
        failing = [item for item in span if item.state is State.FAILING]
        # The offset stops before the first FAILED message until its dead letter is sent:
        # what is applied behind it gets its record, so a read again answers it DUPLICATE.
        # A FAILED record of the key may stand already (a producer's copy, failed before):
        # it says the same. (A plain batch's first attempt has none: nothing failed yet.)
        untried = batch.plain and batch.rounds == 0 and not failing
        behind = [] if untried else _behind_failed(batch, runnable)
        return (yield from self._commit(batch, runnable, behind, failing, exact=False))

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
        self,
        batch: Batch,
        handled: list[Item],
        ours: list[Item],
        failing: list[Item],
        exact: bool = True,
        claimed_at: datetime | None = None,
    ) -> Attempt:
        """Write ``ours`` PROCESSED and ``failing`` FAILED (and the source's offset, if the
        batch has a fence), then COMMIT the handlers' work."""
        written = yield from self.records.write(ours, failing, after_handlers=bool(handled))
        if exact and len(written) < len(ours) + len(failing):
            # A twin committed one of these keys meanwhile: undo all, let the lookup decide.
            yield from carry(Rollback())
            return self._report(batch)
        fence = batch.fence
        next_offset: int | None = None
        held_to: int | None = None
        # Every item of the batch is decided by this commit (they are undecided ones): none
        # is RETRY, nothing is left to attempt.
        whole = len(handled) + len(failing) == len(batch.items)
        if fence is not None:
            next_offset, held_to = _offset_write(batch, fence, handled, failing, whole)
            params = fence.params(next_offset, held_to)
            write = Execute(fence.statements.in_batch, params, fence.read)
            if not (yield from carry(write, after_handlers=bool(handled))):
                yield from carry(Rollback())
                self._fenced(batch, fence)
                return self._report(batch)
        if self.records.statements.mysql and claimed_at is not None and handled:
            # MySQL: the last statement before COMMIT proves the claims stamped
            # ``claimed_at`` are still this transaction's (statements.holds).
            held = yield from self.records.holds(handled, claimed_at)
            if not held:  # nothing of this transaction may commit: it is not ours
                raise TransactionFailed(
                    TransactionBroken(
                        "the claims this attempt wrote are gone before its COMMIT: InnoDB "
                        "rolled the transaction back (a deadlock the handler caught, or a "
                        "statement on the raw connection) and a new one began; nothing of "
                        "it is committed or reported done"
                    )
                )
        yield from carry(Commit())
        if fence is not None and next_offset is not None:
            fence.written = next_offset
        if fence is not None and held_to is not None:
            fence.recheck_until = max(fence.recheck_until or held_to, held_to)
        # _tell_breaker of each handled item at once (a runner's batch; direct calls have
        # none): all passed, and a run of failures ends once.
        if decide_processed(handled, batch.breaker is not None):
            assert batch.breaker is not None
            batch.breaker.succeeded()
        for item in failing:
            item.decide(Outcome.FAILED, item.failure)
        if whole:  # nothing undecided, no RETRY to hold the rest back: done
            batch.rounds += 1
            return AttemptReport(pending=False, wait=0.0)
        if batch.limit is not None:  # grow back after a culprit was passed, halving found it
            batch.limit *= 2
        return self._report(batch)

    @staticmethod
    def _fenced(batch: Batch, fence: OffsetFence) -> None:
        """The owner epoch moved on: nothing of this transaction committed, and nothing of
        the batch will (every undecided item ends RETRY, for the partition's new owner)."""
        fence.fenced = True
        why = PartitionFenced(
            f"{fence.topic}[{fence.partition}] of group {fence.group!r} was assigned to "
            f"another consumer (owner epoch past {fence.epoch}): rolled back"
        )
        logger.warning("%s", why)
        for item in batch.undecided():
            item.decide(Outcome.RETRY, why)

    @staticmethod
    def _span(batch: Batch) -> list[Item]:
        """The undecided items from the first one on; an item ALONE runs alone."""
        if batch.rounds == 0 and batch.limit is None:  # the first attempt: none is ALONE yet
            return batch.undecided()
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
        """The culprit runs alone from now on; what precedes it commits first, without waiting
        (the culprit's wait is taken before its own next try: ``_owed``)."""
        if culprit.state is State.DECIDED:  # its claim could not be undone (ClaimNotUndone)
            return self._report(batch)
        transient = self.policy.classify(exc) is ErrorKind.TRANSIENT
        if transient and signature(exc) in batch.spent:
            self._give_up(batch, [culprit], exc)
            return self._report(batch)
        for item in span[: span.index(culprit)]:
            if item.state is State.NEW:  # its handler passed: in message order, before it
                self._tell_breaker(batch, item)
        self._charge(batch, culprit, exc, alone=True)
        return self._report(batch)

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
            return self._report(batch)
        # Our statement or the COMMIT: the database itself is failing, every item alike.
        if transient and batch.spent and undecided:
            self._give_up(batch, undecided, exc)
            return self._report(batch)
        together = len(undecided) > 1  # one line for the span, not one per message
        for item in undecided:
            self._charge(batch, item, exc, alone=not together, log=not together)
        if together:
            keys = [item.key for item in undecided]
            self.attempt_log.failed(keys, undecided[0].attempts, exc, "together")
        return self._report(batch)

    def _charge(
        self, batch: Batch, item: Item, exc: BaseException, alone: bool, log: bool = True
    ) -> None:
        """One more failed try of ``item``: it moves by the table (states.ON_FAILURE),
        logged as it happens (``AttemptLog``)."""
        item.attempts += 1
        kind = self.policy.classify(exc)
        exhausted = item.attempts >= self.policy.attempts
        if exhausted and kind is ErrorKind.TRANSIENT:
            batch.spent.setdefault(signature(exc), item.key)
        step = next_after(kind, item.state is State.FAILING, exhausted)
        if log:
            self.attempt_log.failed([item.key], item.attempts, exc, _THEN[step])
        match step:
            case Next.AGAIN if alone and item.state is State.NEW:
                item.state = State.ALONE
            case Next.FAILING:
                item.waited = item.attempts  # its record is written at once: no wait owed
                item.fail(exc)
                self._tell_breaker(batch, item)
            case Next.RETRY:
                item.decide(Outcome.RETRY, exc)
            case Next.UNRECORDED:
                logger.error("FAILED %r could not be recorded: %s", item.key, describe(exc))
                item.decide(Outcome.FAILED, item.failure)

    def _tell_breaker(self, batch: Batch, item: Item) -> None:
        """Tell the runner's breaker, once per item, in message order as near as the attempts
        go: a handler that passed closes its run of failures (when it passed, even if its
        commit is the next attempt's), one that FAILED adds to it; once it opens, the batch
        stops (``_halt``)."""
        if batch.breaker is None or item.counted:
            return
        item.counted = True
        if item.state is not State.FAILING:
            batch.breaker.succeeded()
        elif item.failure is not None and batch.breaker.failed(item.key, item.failure):
            self._halt(batch)

    @staticmethod
    def _halt(batch: Batch) -> None:
        """The breaker is open: every item not tried to its end yet ends RETRY (not acked,
        delivered again after the fix); the FAILING ones still get their FAILED record."""
        assert batch.breaker is not None
        why = batch.breaker.error()
        for item in batch.items:
            if item.state in (State.NEW, State.ALONE):
                item.decide(Outcome.RETRY, why)

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

    def _report(self, batch: Batch) -> AttemptReport:
        """What the driver does next: attempt again (after a wait) or finish."""
        batch.rounds += 1
        batch.over_budget(self.policy.attempts)
        if batch.ordered:
            batch.hold_back()
        pending = bool(batch.undecided())
        return AttemptReport(pending=pending, wait=self._owed(batch) if pending else 0.0)

    def _owed(self, batch: Batch) -> float:
        """The wait before the next attempt: each message waits by its OWN failures in a row
        (``delay(n)`` after its n-th), taken just before it is tried again, so the schedule
        is the policy's (50, 100, 200 ms ...) for every message of a batch, not only the
        first; a span that only commits its innocent part first waits for nothing."""
        wait = 0.0
        for item in self._span(batch):
            if item.state is not State.FAILING and item.waited < item.attempts:
                wait = max(wait, self.backoff.delay(item.attempts))
                item.waited = item.attempts
        return wait

    @staticmethod
    def finish(batch: Batch) -> list[Result]:
        """One Result per delivery, in the order given (``Batch.results``)."""
        return batch.results()


def _nothing(result: Any) -> None:
    """The read of a statement whose result says nothing (START TRANSACTION)."""


def _next_offset(batch: Batch, committing: set[Item], hold_failed: bool = False) -> int | None:
    """One past the last of the batch's deliveries, from its first on, that are decided
    (not RETRY) or commit with ``committing``; None if the first is neither.
    ``hold_failed``: stop before the first FAILED one too (its dead letter is not sent)."""
    leader_of = {id(f): leader for leader in batch.items for f in leader.followers or ()}
    last: int | None = None
    for slot in batch.slots:
        if isinstance(slot, Result):  # refused at the start: FAILED, unless held back
            if slot.outcome is Outcome.RETRY or hold_failed:
                break
            last = slot.message.offset
            continue
        item = leader_of.get(id(slot), slot)
        if item not in committing and (
            item.state is not State.DECIDED or item.outcome is Outcome.RETRY
        ):
            break
        # A later copy of a key with another payload ends FAILED (PayloadMismatch, in
        # Batch.results) though its leader committed: its dead letter is owed too.
        if hold_failed and (_failed(item) or (item is not slot and slot.hash != item.hash)):
            break
        last = slot.message.offset
    return None if last is None else last + 1


def _offset_write(
    batch: Batch, fence: OffsetFence, handled: list[Item], failing: list[Item], whole: bool
) -> tuple[int | None, int | None]:
    """The next offset a commit of ``handled`` and ``failing`` writes, and the chunk's end
    if that offset is held before it (``held_to``: raises recheck_until), else None.

    A FAILED record's offset waits for its dead letter (the runner moves it on once the
    letter is sent): killed before, it is read again, and its record answers
    RecordedFailure, its batch-mates behind it DUPLICATE (with claims, or offsets only by
    the records _by_offset writes for them and fence.recheck)."""
    end = _past(batch.slots[-1].message.offset)
    if whole and batch.plain and not failing:  # all of it, in order: past its last
        next_offset = end
    else:
        next_offset = _next_offset(batch, {*handled, *failing}, hold_failed=True)
    if fence.written is not None and (next_offset or 0) < fence.written:
        next_offset = fence.written  # never back: what is below it committed before
    elif next_offset is None and fence.written is None:
        # Held at the partition's first record: stored as where to start, or a restart
        # would start where the group's offset or auto_offset_reset says ("latest": past a
        # FAILED record whose dead letter was not sent yet).
        next_offset = batch.slots[0].message.offset
    # Held before the chunk's end: records of this commit may stand past the offset, and a
    # chunk read again below ``end`` looks its ids up (fence.recheck).
    held = next_offset is None or (end is not None and next_offset < end)
    return next_offset, end if held else None


def _past(offset: int | None) -> int | None:
    return None if offset is None else offset + 1


def _behind_failed(batch: Batch, items: Sequence[Item]) -> list[Item]:
    """Those of ``items`` that come after a FAILED (or refused) delivery of the batch."""
    chosen = {id(item) for item in items}
    behind: list[Item] = []
    seen = False
    for slot in batch.slots:
        if isinstance(slot, Result):
            seen = seen or slot.outcome is Outcome.FAILED
            continue
        if seen and id(slot) in chosen:
            behind.append(slot)
        seen = seen or _failed(slot)
    return behind


def _failed(item: Item) -> bool:
    """FAILED, or failing in the transaction that commits now (its record written)."""
    if item.state is State.DECIDED:
        return item.outcome is Outcome.FAILED
    return item.state is State.FAILING


_THEN = {
    Next.AGAIN: "tried again",
    Next.FAILING: "FAILED",
    Next.RETRY: "RETRY: not acked, delivered again",
    Next.UNRECORDED: "FAILED, unrecorded",
}
"""What a failed attempt's log line says comes next."""
