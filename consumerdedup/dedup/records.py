"""The dedup records of a batch's items: written and looked up, as operations for a driver."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from datetime import datetime
from typing import Any

from ..errors import PayloadMismatch, RecordedFailure
from ..outcome import Outcome
from ..reasons import describe
from ..schema import utcnow
from .failures import carry
from .ops import Execute, Op
from .statements import Recorded, Statements
from .states import Item


class Records:
    """One consumer's rows in processed_events, written and read through ``carry``."""

    def __init__(self, statements: Statements, consumer: str) -> None:
        self.statements = statements
        self.consumer = consumer

    def write(
        self,
        processed: Sequence[Item],
        failed: Sequence[Item],
        *,
        after_handlers: bool = False,
        now: datetime | None = None,
    ) -> Generator[Op, Any, set[str]]:
        """INSERT the rows ON CONFLICT DO NOTHING; send back the keys that were ours.

        ``processed`` get a PROCESSED row (a claim, or check-first's record after its
        handler), ``failed`` a FAILED row with their failure. On a partitioned table,
        where nothing can conflict, the keys are locked first, and the INSERT skips
        those any partition already holds. ``after_handlers``: see RecordRefused. ``now``:
        the time stamped in the rows (a claim's, which ``unclaim`` matches), else the time.
        """
        now = now or utcnow()
        rows = [self._row(item, now, None) for item in processed]
        rows += [self._row(item, now, item.failure) for item in failed]
        if not rows:
            return set()
        if self.statements.serialized:
            keys = [row["message_id"] for row in rows]
            lock = self.statements.lock(self.consumer, keys)
            yield from carry(Execute(*lock, Statements.read_lock), after_handlers=after_handlers)
        inserted: set[str] = set()
        for statement, params in self.statements.records(rows):
            insert = Execute(statement, params, Statements.read_recorded)
            inserted |= yield from carry(insert, after_handlers=after_handlers)
        return inserted

    def unclaim(self, items: Sequence[Item], claimed_at: datetime) -> Generator[Op, Any, int]:
        """DELETE the claims of ``items`` stamped ``claimed_at`` (statements.unclaims); send
        back how many rows went (none if they were never committed)."""
        removed = 0
        keys = [item.key for item in items]
        for statement, params in self.statements.unclaims(self.consumer, keys, claimed_at):
            removed += yield from carry(Execute(statement, params, Statements.read_count))
        return removed

    def holds(self, items: Sequence[Item], claimed_at: datetime) -> Generator[Op, Any, bool]:
        """MySQL, the last statement before COMMIT: this transaction still holds every claim
        of ``items`` stamped ``claimed_at`` (statements.holds)."""
        held = 0
        keys = [item.key for item in items]
        for statement, params in self.statements.holds(self.consumer, keys, claimed_at):
            held += yield from carry(Execute(statement, params, Statements.read_scalar))
        return held == len(keys)

    def look_up(self, items: Sequence[Item]) -> Generator[Op, Any, list[Item]]:
        """Decide the items a record already exists for; send back the others, in order."""
        if not items:
            return []
        found: dict[str, Recorded] = {}
        for statement, params in self.statements.lookups(self.consumer, [i.key for i in items]):
            found |= yield from carry(Execute(statement, params, Statements.read_lookup))
        return [item for item in items if not self._decide(item, found.get(item.key))]

    @staticmethod
    def _decide(item: Item, row: Recorded | None) -> bool:
        """Decide an item by its record; False if there is none (it was never processed)."""
        if row is None:
            return False
        if row.payload_hash != item.hash:
            item.decide(Outcome.FAILED, PayloadMismatch(item.key, row.payload_hash, item.hash))
        elif row.outcome == Outcome.FAILED.value:
            item.decide(Outcome.FAILED, RecordedFailure(row.error or "failed before"))
        else:
            item.decide(Outcome.DUPLICATE)
        return True

    def _row(self, item: Item, now: datetime, error: BaseException | None) -> dict[str, Any]:
        return {
            "consumer": self.consumer,
            "message_id": item.key,
            "payload_hash": item.hash,
            "processed_at": now,
            "outcome": (Outcome.FAILED if error else Outcome.PROCESSED).value,
            "error": describe(error) if error else None,
        }
