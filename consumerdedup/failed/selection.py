"""Which dead letters a replay takes: ``Selection`` (``failed replay --consumer --reason
--error-type --since --until --only-recorded``).

A dead letter is judged by its own headers (its consumer, its reason) and by its record in
processed_events, read just before the replay forgets it:

- ``reason``: the reason header contains the text, in any case.
- ``error_type``: the reason names this exception type first, as every reason the library
  writes does (``KeyError: 'sku'``): exactly that class name, case and all.
- ``since`` / ``until``: the time it failed, which its FAILED record holds (``since``
  inclusive, ``until`` exclusive). A letter without a FAILED record has no known time and
  matches neither.
- ``only_recorded``: a letter with no record at all is kept (not replayed) instead of
  replayed as a new message.

The rule for a letter without any record (its FAILED record pruned, or forgotten by
``failed forget`` or by a replay killed after forgetting its batch): by default it is
replayed, processed as a new message, and counted in the summary. The one risk: if the
message completed later through another copy and that record was pruned too, it applies
again; ``only_recorded`` rules that out, at the price of leaving such letters in the DLQ.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Engine

from ..options import boolean, instance, matching, maybe, refuse, text
from ..outcome import Outcome
from ..schema import Tables
from .records import states
from .report import DeadLetter

TYPE_NAME = re.compile(r"[A-Za-z_]\w*")
AWARE = "a timezone-aware datetime"
UNRECORDED = (
    "no record of it (pruned, or forgotten): kept, as --only-recorded asks; "
    "replay it without --only-recorded to process it as a new message"
)


@dataclass(frozen=True, slots=True)
class Selection:
    """Which dead letters to replay; None (False): no condition."""

    consumer: str | None = None
    reason: str | None = None
    error_type: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    only_recorded: bool = False
    message_ids: frozenset[str] | None = None
    """Only the dead letters of these messages (the admin page's chosen records)."""

    def __post_init__(self) -> None:
        for name in ("consumer", "reason"):
            maybe(getattr(self, name), f"Selection.{name}", text)
        maybe(self.error_type, "Selection.error_type", matching, TYPE_NAME, "a class name")
        for name in ("since", "until"):
            value = maybe(getattr(self, name), f"Selection.{name}", instance, datetime, AWARE)
            if value is not None and value.tzinfo is None:
                raise refuse(f"Selection.{name}", value, AWARE)
        boolean(self.only_recorded, "Selection.only_recorded")
        ids = maybe(self.message_ids, "Selection.message_ids", instance, frozenset, "a frozenset")
        if ids is not None and not all(isinstance(i, str) for i in ids):
            raise refuse("Selection.message_ids", ids, "a frozenset of str")

    @property
    def filters(self) -> bool:
        """Whether any condition can leave a letter out (then a Kafka replay's offsets stop
        at the first letter left out)."""
        chosen = (self.consumer, self.reason, self.error_type, self.since, self.until)
        return any(chosen) or self.message_ids is not None

    def matches(self, letter: DeadLetter, failed_at: datetime | None) -> bool:
        """Whether ``letter`` (whose FAILED record, if any, says it failed at ``failed_at``)
        is one to replay."""
        if self.consumer is not None and letter.consumer != self.consumer:
            return False
        if self.message_ids is not None and letter.message_id not in self.message_ids:
            return False
        reason = letter.reason or ""
        if self.reason is not None and self.reason.casefold() not in reason.casefold():
            return False
        if self.error_type is not None and reason.partition(":")[0].strip() != self.error_type:
            return False
        if self.since is None and self.until is None:
            return True
        if failed_at is None:
            return False
        return (self.since is None or failed_at >= self.since) and (
            self.until is None or failed_at < self.until
        )


def judge(
    engine: Engine, tables: Tables, letters: Sequence[DeadLetter], selection: Selection
) -> list[tuple[bool, bool]]:
    """For each of ``letters``: whether ``selection`` takes it, and whether it has a record
    (of any outcome) now, read in one query per consumer before anything is forgotten."""
    keys = [(x.consumer, x.message_id) for x in letters if x.consumer and x.message_id]
    found = states(engine, keys, tables=tables) if keys else {}
    judged = []
    for letter in letters:
        state = found.get((str(letter.consumer), str(letter.message_id)))
        failed_at = state[1] if state and state[0] == Outcome.FAILED.value else None
        judged.append((selection.matches(letter, failed_at), state is not None))
    return judged
