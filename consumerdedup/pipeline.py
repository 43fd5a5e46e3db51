"""The one decision logic of the pipeline, as a generator.

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

from .errors import (
    ConfigurationError,
    InvalidMessage,
    PayloadMismatch,
    RecordedFailure,
    describe,
)
from .message import Message, payload_hash, validate_id
from .ops import (
    Attempt,
    AttemptReport,
    CallHandler,
    Commit,
    EndSavepoint,
    Execute,
    Op,
    Rollback,
    Savepoint,
)
from .outcome import Outcome, Result
from .retry import ErrorKind, RetryPolicy
from .statements import Recorded, Statements, utcnow


@dataclass(eq=False)
class _Item:
    """One distinct key of a batch and what is known of it so far."""

    message: Message
    key: str
    hash: str
    attempts: int = 0
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
    careful: bool = False
    """A handler failed in the optimistic pass: from now on one savepoint per message."""


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

    def start(self, messages: Sequence[Message]) -> Batch:
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
        return Batch(slots, list(leaders.values()))

    def attempt(self, batch: Batch) -> Attempt:
        """One transaction over the undecided items; decides every item it can.

        The hot path claims every key with one INSERT (claim-first) and runs the
        handlers without savepoints. If a handler raises, the transaction rolls
        back and the next attempt runs one savepoint per message, so only the
        failing message is left out.
        """
        todo = [item for item in batch.items if item.result is None]
        optimistic_claim = self.claim_first and not batch.careful
        handled: list[_Item] = []  # handler succeeded, waiting on COMMIT
        try:
            claimed: set[str] = set()
            runnable = [item for item in todo if item.refused is None]
            if optimistic_claim and runnable:
                claimed = yield from self._insert(runnable, [])
            unknown = [item for item in todo if item.key not in claimed]
            if unknown:
                found = yield self._lookup([item.key for item in unknown])
                unknown = [item for item in unknown if not self._decide_recorded(item, found)]
            if optimistic_claim:
                fresh = [item for item in runnable if item.key in claimed]
                # Neither claimed nor recorded: a twin committed in between; look again.
                conflicted = any(item.refused is None for item in unknown)
            else:
                fresh = [item for item in unknown if item.refused is None]
                conflicted = False
            if batch.careful:
                lost = yield from self._run_guarded(fresh, handled)
                conflicted = conflicted or lost
            elif not (yield from self._run_optimistic(fresh, handled)):
                batch.careful = len(fresh) > 1
                alone = fresh[0] if len(fresh) == 1 else None
                backoff = alone is not None and alone.refused is None
                return AttemptReport(pending=self._pending(todo), backoff=backoff)
            refused = [item for item in todo if item.result is None and item.refused]
            ours = [] if self.claim_first else handled
            if (ours or refused) and len((yield from self._insert(ours, refused))) < len(
                ours + refused
            ):
                # A twin committed one of these keys meanwhile: undo all, let the lookup decide.
                yield Rollback()
                return AttemptReport(pending=True, backoff=False)
            yield Commit()
        except ConfigurationError:
            raise  # a wrong setup is no message's failure: the caller must hear of it
        except Exception as exc:  # the transaction itself failed: nothing of it stands
            # Every undecided item pays an attempt, or an unreachable database would
            # be retried forever instead of ending in RETRY.
            for item in todo:
                if item.result is None:
                    self._note_failure(item, exc)
            return AttemptReport(pending=self._pending(todo), backoff=True)
        for item in handled:
            item.decide(Outcome.PROCESSED)
        for item in refused:
            item.decide(Outcome.FAILED, item.refused)
        pending = self._pending(todo)
        return AttemptReport(pending=pending, backoff=pending and not conflicted)

    def _run_optimistic(
        self, fresh: Sequence[_Item], handled: list[_Item]
    ) -> Generator[Op, Any, bool]:
        """Run the handlers back to back; on the first failure roll back and say so."""
        for item in fresh:
            try:
                yield CallHandler(item.message)
            except Exception as exc:
                self._note_failure(item, exc)
                handled.clear()
                yield Rollback()
                return False
            handled.append(item)
        return True

    def _run_guarded(
        self, fresh: Sequence[_Item], handled: list[_Item]
    ) -> Generator[Op, Any, bool]:
        """One savepoint per message, so a failure undoes that message only.

        Returns True if a twin had committed a key this run wanted to claim.
        """
        lost = False
        for item in fresh:
            savepoint = yield Savepoint()
            try:
                if self.claim_first and not (yield from self._insert([item], [])):
                    lost = True  # a twin committed it; the next lookup decides
                else:
                    yield CallHandler(item.message)
                    handled.append(item)
                    yield EndSavepoint(savepoint, commit=True)
                    continue
            except Exception as exc:  # the handler's or its statements' failure
                self._note_failure(item, exc)
            yield EndSavepoint(savepoint, commit=False)
        return lost

    def finish(self, batch: Batch) -> list[Result]:
        """One Result per message, in the order given; followers take their leader's fate."""
        results: list[Result] = []
        for slot in batch.slots:
            if isinstance(slot, Result):
                results.append(slot)
                continue
            assert slot.result is not None, "finish() before every item was decided"
            results.append(slot.result)
            for follower in slot.followers:
                follower.result = self._follow(slot.result, follower)
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
            yield Execute(*self.statements.lock(self.consumer, keys), Statements.read_lock)
        statement, params = self.statements.record(rows)
        try:
            inserted: set[str] = yield Execute(statement, params, Statements.read_recorded)
        except Exception as exc:
            misconfigured = Statements.misconfigured(exc)
            if misconfigured is not None:
                raise misconfigured from exc
            raise
        return inserted

    def _lookup(self, keys: Sequence[str]) -> Execute:
        statement, params = self.statements.lookup(self.consumer, keys)
        return Execute(statement, params, Statements.read_lookup)

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

    def _note_failure(self, item: _Item, exc: BaseException) -> None:
        """Count a failed try: refuse the item for good, give up on it (RETRY), or try again."""
        item.attempts += 1
        kind = self.policy.classify(exc)
        exhausted = item.attempts >= self.policy.attempts
        if kind is ErrorKind.PERMANENT or (kind is ErrorKind.UNKNOWN and exhausted):
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
