"""The one decision logic of the pipeline, as a generator.

The logic never touches a database itself. It yields operations (run this
statement, call the handler, commit, roll back) and the sync and async
drivers carry them out, sending results back or throwing errors in. So the
blocking and the asyncio deduplicators share every decision, statement and
error rule, and differ only in whether they ``await``.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ..errors import (
    ConfigurationError,
    HeldBack,
    InvalidMessage,
    PayloadMismatch,
    PermanentError,
    RecordedFailure,
    RetryLater,
)
from ..message import Message, payload_hash, validate_id
from ..observe import logger
from ..outcome import Outcome, Result
from ..reasons import describe
from ..retry import ErrorKind, RetryPolicy, too_big
from ..schema import utcnow
from .ops import (
    Attempt,
    AttemptReport,
    CallHandler,
    Commit,
    Execute,
    HandlerRaised,
    Op,
    Rollback,
)
from .statements import Recorded, Statements


@dataclass(eq=False)
class _Item:
    """One distinct key of a batch and what is known of it so far."""

    message: Message
    key: str
    hash: str
    attempts: int = 0
    blamed: bool = False
    """Its own handler or statement failed: from now on it runs alone, after what precedes it."""
    refused: BaseException | None = None
    """A permanent failure seen in an earlier try, waiting to be recorded as FAILED."""
    result: Result | None = None
    followers: list[_Item] = field(default_factory=list)

    def decide(self, outcome: Outcome, error: BaseException | None = None) -> None:
        tries = self.attempts + (1 if outcome is Outcome.PROCESSED else 0)
        self.result = Result(self.message, outcome, error, max(tries, 1))


@dataclass(eq=False)
class Batch:
    """One call's messages: a slot per message, an item per distinct key."""

    slots: list[Result | _Item]
    items: list[_Item]
    ordered: bool = False
    """An ordered source: nothing commits behind a message that is to be retried."""
    limit: int | None = None
    """At most this many items in the next transaction: halved while a failure names no culprit."""
    rounds: int = 0
    """Attempts so far: past a budget, whatever is undecided ends RETRY, come what may."""
    spent: dict[str, str] = field(default_factory=dict)
    """Per transient failure (its ``signature``), the key whose attempts it used up: the
    same failure again in this batch ends what remains RETRY at once, so one outage costs
    one message's attempts, not every message's in turn. Another failure (one message
    type's missing table, after another's timeout) is not that outage: it is tried as any,
    or one message's fault would keep the healthy messages behind it untried for good."""


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
        self,
        statements: Statements,
        consumer: str,
        policy: RetryPolicy,
        claim_first: bool,
    ) -> None:
        self.statements = statements
        self.consumer = consumer
        self.policy = policy
        self.claim_first = claim_first

    def start(self, messages: Sequence[Message], ordered: bool = False) -> Batch:
        """Validate and collapse a batch: one slot per message, one work item per key.

        Invalid messages are decided here (FAILED, nothing recorded: they have
        no usable key). Later copies of a key follow the first one's fate.
        """
        slots: list[Result | _Item] = []
        leaders: dict[str, _Item] = {}
        for message in messages:
            try:
                key = validate_id(message.id)
                digest = payload_hash(message.body)
            except InvalidMessage as exc:
                slots.append(Result(message, Outcome.FAILED, exc))
                continue
            item = _Item(message, key, digest)
            leader = leaders.get(key)
            if leader is None:
                leaders[key] = item
            else:
                leader.followers.append(item)
            slots.append(item)
        return Batch(slots, list(leaders.values()), ordered)

    def attempt(self, batch: Batch) -> Attempt:
        """One transaction over the next span of undecided items; decides every item it can."""
        span = self._span(batch)
        handled: list[_Item] = []  # handler succeeded, waiting on COMMIT
        try:
            claimed: set[str] = set()
            runnable = [item for item in span if item.refused is None]
            if self.claim_first and runnable:
                claimed = yield from self._insert(runnable, [])
            unknown = [item for item in span if item.key not in claimed]
            if unknown:
                found = yield from self._lookup([item.key for item in unknown])
                unknown = [item for item in unknown if not self._decide_recorded(item, found)]
            # Claim-first: a key neither claimed nor recorded was committed by a twin in
            # between; it stays undecided and the next attempt looks again. On an ordered
            # source nothing behind it may commit first: the whole span waits.
            if self.claim_first and batch.ordered and any(i.refused is None for i in unknown):
                yield Rollback()
                return self._report(batch, backoff=False)
            if self.claim_first:
                fresh = [item for item in runnable if item.key in claimed]
            else:
                fresh = [item for item in unknown if item.refused is None]
            for item in fresh:
                try:
                    yield CallHandler(item.message)
                except HandlerRaised as raised:  # the user's code: this message's failure
                    yield Rollback()
                    return self._handler_failed(batch, span, item, raised.error)
                except ConfigurationError:
                    raise  # the driver's own check of the handler: a setup fault
                except Exception as exc:  # the handler broke the transaction (TransactionBroken)
                    yield Rollback()
                    return self._handler_failed(batch, span, item, exc)
                handled.append(item)
            refused = [item for item in span if item.result is None and item.refused]
            ours = [] if self.claim_first else handled
            if (ours or refused) and len((yield from self._record(ours, refused, handled))) < len(
                ours + refused
            ):
                # A twin committed one of these keys meanwhile: undo all, let the lookup decide.
                yield Rollback()
                return self._report(batch, backoff=False)
            yield Commit()
        except ConfigurationError:
            raise  # our own statements met a wrong setup: no message's failure, the caller's
        except Exception as exc:  # the transaction itself failed: nothing of it stands
            return self._transaction_failed(batch, span, exc)
        for item in handled:
            item.decide(Outcome.PROCESSED)
        for item in refused:
            item.decide(Outcome.FAILED, item.refused)
        if batch.limit is not None:  # grow back after a culprit was passed, halving found it
            batch.limit *= 2
        return self._report(batch, backoff=False)

    def _span(self, batch: Batch) -> list[_Item]:
        """The undecided items from the first one on; a blamed item runs alone."""
        span: list[_Item] = []
        for item in batch.items:
            if item.result is not None:
                continue
            alone = item.blamed and item.refused is None
            if alone and span:
                break
            span.append(item)
            if alone or (batch.limit is not None and len(span) >= batch.limit):
                break
        return span

    def _handler_failed(
        self, batch: Batch, span: Sequence[_Item], culprit: _Item, exc: Exception
    ) -> AttemptReport:
        """The culprit runs alone from now on; what precedes it commits first, without waiting."""
        transient = self.policy.classify(exc) is ErrorKind.TRANSIENT
        if transient and signature(exc) in batch.spent:
            self._give_up(batch, [culprit], exc)
            return self._report(batch, backoff=False)
        culprit.blamed = True
        self._note_failure(batch, culprit, exc)
        before = span[: span.index(culprit)]
        first = not any(item.result is None for item in before)
        return self._report(batch, backoff=first and culprit.refused is None)

    def _transaction_failed(
        self, batch: Batch, span: Sequence[_Item], exc: Exception
    ) -> AttemptReport:
        """A statement of ours or the COMMIT failed: a transient error charges every item of
        the span (or an unreachable database would be retried forever); any other error
        halves the span until it names its culprit (a deferred constraint fails at COMMIT)."""
        undecided = [item for item in span if item.result is None]
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
            item.blamed = item.blamed or len(undecided) == 1
            self._note_failure(batch, item, exc)
        return self._report(batch, backoff=True)

    @staticmethod
    def _give_up(batch: Batch, failed: Sequence[_Item], exc: Exception) -> None:
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
            if item.result is None:
                item.decide(Outcome.RETRY, why)

    def _report(self, batch: Batch, backoff: bool) -> AttemptReport:
        batch.rounds += 1
        # Every attempt decides, halves or charges something; the budget bounds the rest.
        per_item = self.policy.attempts + 3 + 2 * len(batch.items).bit_length()
        if batch.rounds >= len(batch.items) * per_item + 16:
            for item in batch.items:
                if item.result is None:
                    item.decide(
                        Outcome.RETRY, RetryLater(f"undecided after {batch.rounds} attempts")
                    )
        if batch.ordered:
            self._hold_back(batch)
        pending = self._pending(batch.items)
        return AttemptReport(pending=pending, backoff=pending and backoff)

    @staticmethod
    def _hold_back(batch: Batch) -> None:
        """On an ordered source, everything behind a message to retry is retried with it."""
        retried = [i for i, item in enumerate(batch.items) if _outcome(item) is Outcome.RETRY]
        if not retried:
            return
        ahead = batch.items[retried[0]]
        for item in batch.items[retried[0] + 1 :]:
            if item.result is None:
                item.decide(Outcome.RETRY, HeldBack(f"behind {ahead.key!r}, which is retried"))

    def finish(self, batch: Batch) -> list[Result]:
        """One Result per message, in the order given; followers take their leader's fate.

        Ordered: a FAILED behind the first RETRY is RETRY too (an unusable id, a
        RecordedFailure or PayloadMismatch the lookup found, a copy whose payload differs
        from its leader's), or it would be dead-lettered again each time it is read again.
        None of them committed anything here: a record commits only after every item
        before it is decided, so no recorded failure stands behind a RETRY.
        """
        results: list[Result] = []
        ahead: Message | None = None
        for slot in batch.slots:
            if isinstance(slot, Result):
                result = slot
            else:
                assert slot.result is not None, "finish() before every item was decided"
                result = slot.result
                for follower in slot.followers:
                    follower.result = self._follow(result, follower)
            if batch.ordered and ahead is not None and result.outcome is Outcome.FAILED:
                why = HeldBack(f"behind {ahead.id!r}, which is retried")
                result = Result(result.message, Outcome.RETRY, why)
            results.append(result)
            if ahead is None and result.outcome is Outcome.RETRY:
                ahead = result.message
        return results

    def _insert(
        self, processed: Sequence[_Item], failed: Sequence[_Item]
    ) -> Generator[Op, Any, set[str]]:
        """INSERT the dedup rows ON CONFLICT DO NOTHING; send back the keys that were ours.

        On a partitioned table, where nothing can conflict, the keys are locked
        first, and the INSERT skips those any partition already holds.
        """
        now = utcnow()
        rows = [self._row(item, now, None) for item in processed]
        rows += [self._row(item, now, item.refused) for item in failed]
        if not rows:
            return set()
        if self.statements.serialized:
            keys = [row["message_id"] for row in rows]
            lock = Execute(*self.statements.lock(self.consumer, keys), Statements.read_lock)
            yield from self._ours(lock)
        inserted: set[str] = set()
        for statement, params in self.statements.records(rows):
            inserted |= yield from self._ours(Execute(statement, params, Statements.read_recorded))
        return inserted

    def _record(
        self, processed: Sequence[_Item], failed: Sequence[_Item], handled: Sequence[_Item]
    ) -> Generator[Op, Any, set[str]]:
        """``_insert`` after handlers ran in this transaction: a setup error there may be a
        handler's doing (``set_config('transaction_read_only', ...)``, ``SET ROLE``), so it
        is no setup fault yet: the span halves down to the culprit, whose FAILED record is
        then written with no handler in its transaction (where a real setup fault stops)."""
        try:
            return (yield from self._insert(processed, failed))
        except ConfigurationError as exc:
            if not handled:
                raise
            raise RecordRefused(
                f"the dedup record could not be written after the handler ran ({describe(exc)})"
            ) from exc

    def _lookup(self, keys: Sequence[str]) -> Generator[Op, Any, dict[str, Recorded]]:
        found: dict[str, Recorded] = {}
        for statement, params in self.statements.lookups(self.consumer, keys):
            found |= yield from self._ours(Execute(statement, params, Statements.read_lookup))
        return found

    @staticmethod
    def _ours(execute: Execute) -> Generator[Op, Any, Any]:
        """One of our statements: a failure that is the setup's, not the message's, is raised;
        one the driver gives no code for is marked, so that it splits the span."""
        try:
            return (yield execute)
        except Exception as exc:
            misconfigured = Statements.misconfigured(exc)
            if misconfigured is not None:
                raise misconfigured from exc
            if too_big(exc):
                raise StatementRefused(exc) from exc
            raise

    def _row(self, item: _Item, now: datetime, error: BaseException | None) -> dict[str, Any]:
        return {
            "consumer": self.consumer,
            "message_id": item.key,
            "payload_hash": item.hash,
            "processed_at": now,
            "outcome": (Outcome.FAILED if error else Outcome.PROCESSED).value,
            "error": describe(error) if error else None,
        }

    def _decide_recorded(self, item: _Item, found: dict[str, Recorded]) -> bool:
        """Decide an item the lookup found; False if it was never processed."""
        row = found.get(item.key)
        if row is None:
            return False
        if row.payload_hash != item.hash:
            item.decide(Outcome.FAILED, PayloadMismatch(item.key, row.payload_hash, item.hash))
        elif row.outcome == Outcome.FAILED.value:
            item.decide(Outcome.FAILED, RecordedFailure(row.error or "failed before"))
        else:
            item.decide(Outcome.DUPLICATE)
        return True

    def _note_failure(self, batch: Batch, item: _Item, exc: BaseException) -> None:
        """Count a failed try: refuse the item for good, give up on it (RETRY), or try again."""
        item.attempts += 1
        kind = self.policy.classify(exc)
        exhausted = item.attempts >= self.policy.attempts
        if exhausted and kind is ErrorKind.TRANSIENT:
            batch.spent.setdefault(signature(exc), item.key)
        if item.refused is not None:  # its FAILED record did not commit
            if exhausted and kind is ErrorKind.TRANSIENT:
                item.decide(Outcome.RETRY, exc)
            elif exhausted:
                # Bounded even when the failure cannot be stored: dead-lettered unrecorded.
                logger.error("FAILED %r could not be recorded: %s", item.key, describe(exc))
                item.decide(Outcome.FAILED, item.refused)
        elif kind is ErrorKind.PERMANENT or (kind is ErrorKind.UNKNOWN and exhausted):
            item.refused = exc
        elif exhausted:
            item.decide(Outcome.RETRY, exc)

    @staticmethod
    def _pending(items: Sequence[_Item]) -> bool:
        return any(item.result is None for item in items)

    @staticmethod
    def _follow(leader: Result, follower: _Item) -> Result:
        first = leader.message
        if follower.hash != payload_hash(first.body):
            mismatch = PayloadMismatch(follower.key, payload_hash(first.body), follower.hash)
            return Result(follower.message, Outcome.FAILED, mismatch)
        if leader.outcome in (Outcome.PROCESSED, Outcome.DUPLICATE):
            return Result(follower.message, Outcome.DUPLICATE)
        return Result(follower.message, leader.outcome, leader.error, leader.attempts)


class StatementRefused(Exception):
    """One of our statements failed for its size: with no SQLSTATE nor SQLite code on a live
    connection (the driver refused it: too many parameters, a value it cannot send), or the
    server ran out of lock memory or a program limit (retry.too_big). Halved, not
    retried as is; a lone item's failure is then classified by ``error`` as usual."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


class RecordRefused(PermanentError):
    """Our record was refused as by a setup fault, in a transaction where a handler ran."""


def signature(exc: BaseException) -> str:
    """Which failure this is, to tell one outage from another message's own failure: the
    exception's type, and the database's code (or the driver error's type) under it."""
    cause = getattr(exc, "cause", None) or exc  # TransactionBroken: what was swallowed
    orig = getattr(cause, "orig", None)
    code = getattr(orig, "sqlstate", None) or getattr(orig, "sqlite_errorname", None)
    name = type(cause).__qualname__
    return f"{name}/{code or type(orig).__qualname__}" if orig is not None else name


def _outcome(item: _Item) -> Outcome | None:
    return None if item.result is None else item.result.outcome
