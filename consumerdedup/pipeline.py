"""The one decision logic: check -> BEGIN -> handle -> INSERT -> COMMIT, as a generator.

The logic never touches a database itself. It yields operations (run this
statement, call the handler, open a savepoint, commit) and the sync and async
drivers carry them out, sending results back or throwing errors in. So the
blocking and the asyncio deduplicators share every decision, statement and
error rule, and differ only in whether they ``await``.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from .errors import InvalidMessage, PayloadMismatch, RecordedFailure, describe
from .message import Message, payload_hash, validate_id
from .outcome import Outcome, Result
from .retry import ErrorKind, RetryPolicy
from .statements import Recorded, Statements, utcnow


# The operations a driver carries out. Each returns what the logic is sent back.
@dataclass(frozen=True, slots=True)
class Execute:
    """Run ``statement`` with ``params``; send back ``read(result)``."""

    statement: Any
    params: Any
    read: Any


@dataclass(frozen=True, slots=True)
class CallHandler:
    message: Message


@dataclass(frozen=True, slots=True)
class Savepoint:
    """Open a savepoint; send back its handle."""


@dataclass(frozen=True, slots=True)
class EndSavepoint:
    handle: Any
    commit: bool


@dataclass(frozen=True, slots=True)
class Commit:
    pass


@dataclass(frozen=True, slots=True)
class Rollback:
    pass


Op = Execute | CallHandler | Savepoint | EndSavepoint | Commit | Rollback
Attempt = Generator[Op, Any, "AttemptReport"]


@dataclass(frozen=True, slots=True)
class AttemptReport:
    pending: bool
    """Some messages are still undecided: attempt again."""
    backoff: bool
    """Wait before that attempt (not needed when the only news was a twin's commit)."""


@dataclass(eq=False)
class _Item:
    message: Message
    key: str
    hash: str
    attempts: int = 0
    error: BaseException | None = None
    result: Result | None = None
    followers: list[_Item] = field(default_factory=list)

    def decide(self, outcome: Outcome, error: BaseException | None = None) -> None:
        tries = self.attempts + (1 if outcome is Outcome.PROCESSED else 0)
        self.result = Result(self.message, outcome, error, max(tries, 1))


class Pipeline:
    """Per-consumer settings plus the decision logic over a batch of messages."""

    def __init__(
        self,
        statements: Statements,
        consumer: str,
        policy: RetryPolicy,
        claim_first: bool,
    ) -> None:
        self.statements = statements
        self.consumer = validate_id(consumer)
        self.policy = policy
        self.claim_first = claim_first

    def start(self, messages: Sequence[Message]) -> tuple[list[Result | _Item], list[_Item]]:
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
        return slots, list(leaders.values())

    def attempt(self, items: Sequence[_Item]) -> Attempt:
        """One transaction over the undecided items; decides every item it can."""
        todo = [item for item in items if item.result is None]
        for item in todo:
            item.error = None
        handled: list[_Item] = []  # handler succeeded, waiting on COMMIT
        failing: list[_Item] = []  # permanent failure, its record waiting on COMMIT
        conflicted = False
        try:
            statement, params = self.statements.lookup(self.consumer, [i.key for i in todo])
            found: dict[str, Recorded] = yield Execute(statement, params, Statements.read_lookup)
            fresh = [item for item in todo if not self._decide_recorded(item, found.get(item.key))]
            nested = len(fresh) > 1
            for item in fresh:
                savepoint = (yield Savepoint()) if nested else None
                try:
                    if self.claim_first and not (yield from self._record([item], [])):
                        conflicted = True  # a twin committed it; the next lookup decides
                    else:
                        yield CallHandler(item.message)
                        handled.append(item)
                        if nested:
                            yield EndSavepoint(savepoint, commit=True)
                        continue
                except Exception as exc:  # the handler's or its statements' failure
                    if self._note_failure(item, exc):
                        failing.append(item)
                # Undo this message only: its savepoint, or the whole transaction when alone.
                yield EndSavepoint(savepoint, commit=False) if nested else Rollback()

            ours = [] if self.claim_first else handled
            if (ours or failing) and not (yield from self._record(ours, failing)):
                # A twin committed one of these keys meanwhile: undo all, let the lookup decide.
                yield Rollback()
                return AttemptReport(pending=True, backoff=False)
            yield Commit()
        except Exception as exc:  # the transaction itself failed: nothing of it stands
            for item in handled + failing:
                self._note_failure(item, exc)
            return AttemptReport(pending=self._pending(todo), backoff=True)
        for item in handled:
            item.decide(Outcome.PROCESSED)
        for item in failing:
            item.decide(Outcome.FAILED, item.error)
        pending = self._pending(todo)
        return AttemptReport(pending=pending, backoff=pending and not conflicted)

    def finish(self, slots: list[Result | _Item]) -> list[Result]:
        """One Result per message, in the order given; followers take their leader's fate."""
        results: list[Result] = []
        for slot in slots:
            if isinstance(slot, Result):
                results.append(slot)
                continue
            assert slot.result is not None, "finish() before every item was decided"
            results.append(slot.result)
            for follower in slot.followers:
                follower.result = self._follow(slot.result, follower)
        return results

    def _record(
        self, processed: Sequence[_Item], failed: Sequence[_Item]
    ) -> Generator[Op, Any, bool]:
        """Insert the dedup rows; True if every one was ours (no twin got there first)."""
        now = utcnow()
        rows = [self._row(item, now, None) for item in processed]
        rows += [self._row(item, now, item.error) for item in failed]
        statement, params = self.statements.record(rows)
        inserted: set[str] = yield Execute(statement, params, Statements.read_recorded)
        return len(inserted) == len(rows)

    def _row(self, item: _Item, now: datetime, error: BaseException | None) -> dict[str, Any]:
        return {
            "consumer": self.consumer,
            "message_id": item.key,
            "payload_hash": item.hash,
            "processed_at": now,
            "outcome": (Outcome.FAILED if error else Outcome.PROCESSED).value,
            "error": describe(error) if error else None,
        }

    def _decide_recorded(self, item: _Item, row: Recorded | None) -> bool:
        """Decide an item the lookup found; False if it was never processed."""
        if row is None:
            return False
        if row.payload_hash != item.hash:
            item.decide(Outcome.FAILED, PayloadMismatch(item.key, row.payload_hash, item.hash))
        elif row.outcome == Outcome.FAILED.value:
            item.decide(Outcome.FAILED, RecordedFailure(row.error or "failed before"))
        else:
            item.decide(Outcome.DUPLICATE)
        return True

    def _note_failure(self, item: _Item, exc: BaseException) -> bool:
        """Count a failed try; True if the item must now be recorded as FAILED."""
        item.attempts += 1
        item.error = None
        kind = self.policy.classify(exc)
        exhausted = item.attempts >= self.policy.attempts
        if kind is ErrorKind.PERMANENT or (kind is ErrorKind.UNKNOWN and exhausted):
            item.error = exc
            return True
        if exhausted:
            item.decide(Outcome.RETRY, exc)
        return False

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
