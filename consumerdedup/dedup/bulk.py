"""Bulk handlers in the pipeline: one call with a span's new messages, a failure bisected.

A bulk handler takes the place of the per-message calls of claim-first: the
span is claimed with one multi-row claim as usual, and the handler is called
once with exactly the messages whose claim came back (already recorded keys
and twins within the batch never reach it), in delivery order. Everything
else is the pipeline's own (pipeline.py, states.py): the commit, the FAILED
records, attempts, the order of an ordered source.

When the call raises, the culprit is

- the message the handler names (``BatchMessageFailed``): charged like a
  per-message handler's failure, by the kind of its cause, no bisection;
- the only message of the call, if there is one;
- else unknown: the span is halved, each half in its own transaction, as the
  pipeline already does for a failure that names no culprit. Own transactions
  rather than savepoints: a half that committed is decided for good, so order
  holds (the first half commits before the second runs), the claim locks of a
  failing half are released, an error that only COMMIT reports (a deferred
  constraint) is bisected like any other, and a handler that broke the
  transaction (swallowed an error, aborted it) cannot poison its batch-mates.
  A poison message costs about 2·log2(n) transactions of its batch: after a
  half passes, the next transaction is exactly the other half (the suspects),
  not the pipeline's doubled span, which would take the culprit along again.
"""

from __future__ import annotations

import weakref
from collections.abc import Generator, Sequence
from datetime import datetime
from typing import Any

from ..errors import BatchMessageFailed
from ..message import Message
from ..observe import logger
from ..retry import RetryPolicy
from .failures import HandlerFailed, carry
from .ops import Attempt, AttemptReport, CallBulk, Op
from .pipeline import Pipeline
from .statements import Statements
from .states import Batch, Item, State


class NoCulprit(Exception):
    """The bulk call failed and named no message: the span is to be halved."""


class BulkPipeline(Pipeline):
    """The claim-first pipeline with one handler call per transaction."""

    def __init__(self, statements: Statements, consumer: str, policy: RetryPolicy) -> None:
        super().__init__(statements, consumer, policy, claim_first=True)
        self._suspects: weakref.WeakKeyDictionary[Batch, list[Item]] = weakref.WeakKeyDictionary()
        """Per batch, the last span whose call failed naming no culprit."""

    def attempt(self, batch: Batch) -> Attempt:
        suspects = self._suspects.get(batch)
        if suspects is not None:  # the rest of a failed span, after its first half passed
            live = [item for item in suspects if item.state is not State.DECIDED]
            if not live:
                del self._suspects[batch]
            elif batch.limit is None or len(live) < batch.limit:
                batch.limit = len(live)
        span = self._span(batch)  # the span the pipeline's attempt takes: same batch state
        try:
            return (yield from super().attempt(batch))
        except NoCulprit:
            return self._bisect(batch, span)

    def _handle(
        self, items: Sequence[Item], claimed_at: datetime | None
    ) -> Generator[Op, Any, tuple[Item, Exception] | None]:
        """The one bulk call; at a failure, roll back (undoing the claims if the call ended
        the transaction: Pipeline._rolled_back) and name the culprit (or NoCulprit)."""
        if not items:
            return None
        try:
            yield from carry(CallBulk(tuple(item.message for item in items)))
        except HandlerFailed as failed:
            yield from self._rolled_back(failed, items, claimed_at)
            return culprit(items, failed.error)
        return None

    def _bisect(self, batch: Batch, span: Sequence[Item]) -> AttemptReport:
        """The next transaction takes the first half of this span's undecided items."""
        undecided = [item for item in span if item.state is not State.DECIDED]
        self._suspects[batch] = undecided
        batch.limit = max(1, len(undecided) // 2)
        return self._report(batch)


def culprit(items: Sequence[Item], error: Exception) -> tuple[Item, Exception]:
    """The item a bulk call's ``error`` is charged to, and the error to classify it by."""
    if isinstance(error, BatchMessageFailed):
        named = _named(items, error.message)
        cause = error.cause if isinstance(error.cause, Exception) else error
        if named is not None:
            return named, cause
        logger.warning(
            "bulk handler named %r, which is not among its %d messages: bisecting instead",
            error.message if isinstance(error.message, int | str) else type(error.message),
            len(items),
        )
        error = cause
    if len(items) == 1:
        return items[0], error
    raise NoCulprit(error)


def _named(items: Sequence[Item], named: object) -> Item | None:
    """The item ``named`` means: an index into the handler's list, a Message, or an id."""
    if isinstance(named, bool):
        return None
    if isinstance(named, int):
        return items[named] if 0 <= named < len(items) else None
    for item in items:
        if item.message is named:
            return item
    key = named.id if isinstance(named, Message) else named
    return next((item for item in items if item.key == key), None)
