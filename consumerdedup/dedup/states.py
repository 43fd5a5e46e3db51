"""Where each message of a batch stands in the pipeline, and the one table of failure rules.

An item (one distinct key of a batch) is in exactly one state::

    NEW ──────────┬──> DECIDED        (committed, found recorded, or given up: its Result)
      │           │
      ├─> ALONE ──┤                   (its own failure seen: it runs in a transaction alone)
      │           │
      └─> FAILING ┘                   (failed for good: its FAILED record is to be written)

A refused delivery (the runner's reason, or an id that cannot be a key) is no
item: it is decided FAILED when the batch starts, with nothing recorded.

When an attempt fails, the item charged with the failure takes one more try
and moves by this table (``ON_FAILURE``); the claim-first and check-first modes
and an ordered source follow the same rules::

    error kind   its state    attempts left   attempts used up
    PERMANENT    running      FAILING         FAILING
    UNKNOWN      running      AGAIN           FAILING
    TRANSIENT    running      AGAIN           RETRY
    PERMANENT    FAILING      AGAIN           UNRECORDED
    UNKNOWN      FAILING      AGAIN           UNRECORDED
    TRANSIENT    FAILING      AGAIN           RETRY

"running" is NEW or ALONE; AGAIN keeps the state (NEW becomes ALONE when the
failure was its own); UNRECORDED decides FAILED although the record could not
be written (logged at ERROR), so that even a failure that cannot be stored ends.
Around the table, the pipeline (pipeline.py) adds the rules that are the
batch's: a failure with no culprit halves the span, one outage costs one
message's attempts (``Batch.spent``), and on an ordered source everything
behind the first RETRY is RETRY too (HeldBack).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields

from ..breaker import CircuitBreaker
from ..errors import HeldBack, PayloadMismatch, RetryLater
from ..message import Message, payload_hash
from ..outcome import Outcome, Result
from ..retry import ErrorKind
from .offset_fence import OffsetFence


class State(enum.Enum):
    NEW = "new"
    """Not tried yet, or tried with the span and to be tried again with it."""
    ALONE = "alone"
    """Its own handler or statement failed: it runs alone, after what precedes it."""
    FAILING = "failing"
    """Failed for good: its FAILED record is written in the next transaction, no handler run."""
    DECIDED = "decided"
    """Its Result is known (``Item.result``)."""


class Next(enum.Enum):
    """Where a failed try takes an item (see the table above)."""

    AGAIN = "again"
    FAILING = "failing"
    RETRY = "retry"
    UNRECORDED = "unrecorded"


ON_FAILURE: dict[tuple[ErrorKind, bool], tuple[Next, Next]] = {
    # (error kind, the item is FAILING): (attempts left, attempts used up)
    (ErrorKind.PERMANENT, False): (Next.FAILING, Next.FAILING),
    (ErrorKind.UNKNOWN, False): (Next.AGAIN, Next.FAILING),
    (ErrorKind.TRANSIENT, False): (Next.AGAIN, Next.RETRY),
    (ErrorKind.PERMANENT, True): (Next.AGAIN, Next.UNRECORDED),
    (ErrorKind.UNKNOWN, True): (Next.AGAIN, Next.UNRECORDED),
    (ErrorKind.TRANSIENT, True): (Next.AGAIN, Next.RETRY),
}


def next_after(kind: ErrorKind, failing: bool, exhausted: bool) -> Next:
    """The table, read: where one more failed try of this kind takes an item."""
    return ON_FAILURE[kind, failing][exhausted]


if tuple(f.name for f in fields(Result)) != ("message", "outcome", "error", "attempts"):
    raise ImportError("Result's fields changed: update states._result")  # pragma: no cover
_new_result = Result.__new__
_set_message, _set_outcome, _set_error, _set_attempts = (
    getattr(Result, name).__set__ for name in ("message", "outcome", "error", "attempts")
)


def _result(
    message: Message, outcome: Outcome, error: BaseException | None, attempts: int
) -> Result:
    """``Result(message, outcome, error, attempts)``, made as its frozen ``__init__`` would
    but without an ``object.__setattr__`` per field: once per message of every batch."""
    result = _new_result(Result)
    _set_message(result, message)
    _set_outcome(result, outcome)
    _set_error(result, error)
    _set_attempts(result, attempts)
    return result


@dataclass(eq=False, slots=True)
class Item:
    """One distinct key of a batch and where it stands."""

    message: Message
    key: str
    digest: str | None = None
    """The payload hash, once computed (``hash``); given at once for a body that could
    change or fail to encode later (anything but ``bytes``)."""
    state: State = State.NEW
    attempts: int = 0
    """Failed tries charged to it so far."""
    waited: int = 0
    """Of those, the ones whose backoff wait was taken (or is not owed): the pipeline waits
    ``delay(attempts)`` before its next try while ``waited < attempts`` (pipeline._owed)."""
    counted: bool = False
    """Told to the runner's circuit breaker already (its handler's success or failure)."""
    failure: BaseException | None = None
    """FAILING: the permanent failure its record will carry."""
    result: Result | None = None
    """DECIDED: its Result."""
    followers: list[Item] | None = None
    """Later copies of its key in the batch: they take its fate (None: there are none, the
    usual case, so a batch holds no empty list per message)."""

    @property
    def hash(self) -> str:
        """sha256 of the body (``payload_hash``), computed when first read: only a claim,
        a lookup, a FAILED record or a twin in the batch needs it, and with offsets in the
        database (no claims) most batches need none."""
        if self.digest is None:
            self.digest = payload_hash(self.message.body)
        return self.digest

    def decide(self, outcome: Outcome, error: BaseException | None = None) -> None:
        tries = self.attempts + (1 if outcome is Outcome.PROCESSED else 0)
        self.result = _result(self.message, outcome, error, max(tries, 1))
        self.state = State.DECIDED

    def fail(self, error: BaseException) -> None:
        self.failure = error
        self.state = State.FAILING

    @property
    def outcome(self) -> Outcome | None:
        return None if self.result is None else self.result.outcome


def decide_processed(items: list[Item], count: bool) -> bool:
    """``item.decide(PROCESSED)`` for each of ``items`` (undecided, committed together), in
    one loop: once per message of every batch. ``count``: mark each told to the runner's
    circuit breaker; True if one was not yet (the breaker is then told of a success)."""
    processed, decided = Outcome.PROCESSED, State.DECIDED
    told = False
    for item in items:
        item.result = _result(item.message, processed, None, item.attempts + 1)
        item.state = decided
        if count and not item.counted:
            item.counted = told = True
    return told


@dataclass(eq=False)
class Batch:
    """One call's messages: a slot per message, an item per distinct key."""

    slots: list[Result | Item]
    """A refused delivery's Result (decided at the start), or the item of its key."""
    items: list[Item]
    ordered: bool = False
    """An ordered source: nothing commits behind a message that is to be retried."""
    limit: int | None = None
    """At most this many items in the next transaction: halved while a failure names no culprit."""
    rounds: int = 0
    """Attempts so far: past ``round_budget``, whatever is undecided ends RETRY."""
    breaker: CircuitBreaker | None = None
    """The runner's circuit breaker: once open, no more of the batch is tried (RETRY)."""
    fence: OffsetFence | None = None
    """The source's position, written (fenced by its owner epoch) in every transaction of
    the batch (offset_fence)."""
    twins: bool = False
    """A key comes more than once (its later copies follow its item)."""
    spent: dict[str, str] = field(default_factory=dict)
    """Per transient failure (its ``signature``), the key whose attempts it used up: the
    same failure again in this batch ends what remains RETRY at once, so one outage costs
    one message's attempts, not every message's in turn. Another failure (one message
    type's missing table, after another's timeout) is not that outage: it is tried as any,
    or one message's fault would keep the healthy messages behind it untried for good."""

    @property
    def plain(self) -> bool:
        """Every slot is an item of a key of its own: no refused delivery, no later copy of
        a key (the usual batch: ``_commit`` and ``_by_offset`` skip their walks over it)."""
        return len(self.items) == len(self.slots)

    def undecided(self) -> list[Item]:
        return [item for item in self.items if item.state is not State.DECIDED]

    def over_budget(self, attempts: int) -> bool:
        """Past the budget: end whatever is undecided RETRY, come what may."""
        if self.rounds < round_budget(len(self.items), attempts):
            return False
        for item in self.undecided():
            item.decide(Outcome.RETRY, RetryLater(f"undecided after {self.rounds} attempts"))
        return True

    def hold_back(self) -> None:
        """On an ordered source, everything behind a message to retry is retried with it."""
        first = -1
        for index, item in enumerate(self.items):  # the first RETRY, without a call each
            result = item.result
            if result is not None and result.outcome is Outcome.RETRY:
                first = index
                break
        if first < 0:
            return
        ahead = self.items[first]
        for item in self.items[first + 1 :]:
            if item.state is not State.DECIDED:
                item.decide(Outcome.RETRY, HeldBack(f"behind {ahead.key!r}, which is retried"))

    def results(self) -> list[Result]:
        """One Result per delivery, in the order given; followers take their leader's fate.

        Ordered: a FAILED behind the first RETRY is RETRY too (a refused delivery, an
        unusable id, a RecordedFailure or PayloadMismatch the lookup found, a copy whose
        payload differs from its leader's), or it would be dead-lettered again each time
        it is read again. None of them committed anything here: a record commits only
        after every item before it is decided, so no recorded failure stands behind a RETRY.
        """
        results: list[Result] = []
        ahead: Message | None = None
        for slot in self.slots:
            if isinstance(slot, Result):
                result = slot
            else:
                assert slot.result is not None, "results() before every item was decided"
                result = slot.result
                for follower in slot.followers or ():
                    follower.result = _follow(result, slot, follower)
            if self.ordered and ahead is not None and result.outcome is Outcome.FAILED:
                why = HeldBack(f"behind {ahead.id!r}, which is retried")
                result = Result(result.message, Outcome.RETRY, why)
            results.append(result)
            if ahead is None and result.outcome is Outcome.RETRY:
                ahead = result.message
        return results


def _follow(leader: Result, first: Item, follower: Item) -> Result:
    """A later copy's Result, by its key's first copy (``first``, whose Result is ``leader``).

    Payloads are compared as hashed when the batch started (``Item.hash``), as the offset
    (pipeline._next_offset) compared them: a body a handler changed in place since (a
    bytearray) must not turn a copy FAILED after the offset went past it. A first copy
    refused because the key's record holds another payload is not the payload to match:
    a copy of the recorded one is a DUPLICATE (a chunk read again from a held offset
    starts at such a copy, its recorded twin behind it)."""
    if follower.hash != first.hash:
        error = leader.error
        if (
            leader.outcome is Outcome.FAILED
            and isinstance(error, PayloadMismatch)
            and error.recorded_hash == follower.hash
        ):
            return Result(follower.message, Outcome.DUPLICATE)
        mismatch = PayloadMismatch(follower.key, first.hash, follower.hash)
        return Result(follower.message, Outcome.FAILED, mismatch)
    if leader.outcome in (Outcome.PROCESSED, Outcome.DUPLICATE):
        return Result(follower.message, Outcome.DUPLICATE)
    return Result(follower.message, leader.outcome, leader.error, leader.attempts)


ROUNDS_BEYOND_ATTEMPTS = 3
"""Per item, the attempts it may cost without being charged a try: the one where the
items before it commit without it (its handler failed), the one that writes its FAILED
record, and one redone because a twin committed its key in between."""
ROUNDS_PER_SIZE_BIT = 2
"""Per bit of the batch's size, for a failure that names no culprit: the span halves
down to one item (one attempt per halving), then doubles back after each commit."""
SLACK_ROUNDS = 16
"""So that a small batch survives a few more twin races than the above counts."""


def round_budget(items: int, attempts: int) -> int:
    """At most this many attempts for a batch of ``items`` keys under ``attempts`` tries.

    Every attempt decides, charges, halves or redoes something (see the constants), so
    the rules decide a batch well within it; the budget bounds what they might not
    foresee (a database that answers neither a claim nor a lookup), for invariant 3.
    """
    per_item = attempts + ROUNDS_BEYOND_ATTEMPTS + ROUNDS_PER_SIZE_BIT * items.bit_length()
    return items * per_item + SLACK_ROUNDS
