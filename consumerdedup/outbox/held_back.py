"""Outbox events a pipeline transaction holds back: key locks in hash order, then the rows.

See ``consumerdedup.db.before_commit``: inside a pipeline transaction on PostgreSQL
``Outbox.add`` queues a keyed event here instead of locking its key at once, so a
batch takes its keys' locks in one statement, in one order, just before COMMIT,
and two batches over the same keys wait on each other instead of deadlocking.

A row added inside a savepoint (``session.begin_nested()``) remembers it: when that
savepoint (or one around it) is rolled back, the row goes with it, as a written row
would have. Rows are written in the order they were added.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Integer, Table, TextualSelect, bindparam, event, insert, text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session, SessionTransaction

from ..db import before_commit, locks
from ..db.names import table_sql

_WATCHED = "consumerdedup.outbox_savepoints"
"""session.info: the savepoint rollback listener is on this session."""


def lock_keys(table: Table) -> TextualSelect:
    """``Outbox.add``'s per-key locks (the same lock ids) for many keys, in hash order.

    The ordered subquery is not flattened, so the locks are taken in its order.
    """
    return (
        text(
            f"SELECT count(*) AS locked FROM (SELECT pg_advisory_xact_lock({locks.SPACE_SQL}, h) "
            "FROM (SELECT DISTINCT hashtext(k) AS h FROM unnest(CAST(:keys AS text[])) AS k "
            "ORDER BY h) AS hashes) AS held"
        )
        .bindparams(bindparam("keys"), **locks.space_params(locks.PRODUCER, table))
        .columns(locked=Integer())
    )


@dataclass
class HeldRow:
    row: dict[str, Any]
    savepoint: SessionTransaction | None
    """The innermost savepoint open when it was added (None: none)."""

    def undone_by(self, rolled_back: SessionTransaction) -> bool:
        transaction = self.savepoint
        while transaction is not None:
            if transaction is rolled_back:
                return True
            transaction = transaction.parent
        return False


class HeldBackEvents:
    """One outbox table's held-back rows, in the order they were added."""

    def __init__(self, table: Table) -> None:
        self.lock = lock_keys(table)
        self.insert = insert(table)
        self.held: list[HeldRow] = []

    def _keys(self) -> dict[str, Any]:
        return {"keys": sorted({str(held.row["key"]) for held in self.held})}

    def flush(self, session: Session) -> None:
        if self.held:
            session.execute(self.lock, self._keys())
            session.execute(self.insert, [held.row for held in self.held])

    async def flush_async(self, session: AsyncSession) -> None:
        if self.held:
            await session.execute(self.lock, self._keys())
            await session.execute(self.insert, [held.row for held in self.held])


def hold_back(held: dict[Any, Any], session: Session, table: Table, row: dict[str, Any]) -> None:
    """Queue ``row`` for ``table`` in a transaction's open queue (``before_commit.queue``);
    ``session`` is the (blocking) session the handler adds it through."""
    events = held.setdefault(("outbox", table_sql(table)), HeldBackEvents(table))
    savepoint = session.get_nested_transaction()
    if savepoint is not None and not session.info.get(_WATCHED):
        session.info[_WATCHED] = True
        event.listen(session, "after_soft_rollback", _savepoint_rolled_back)
    events.held.append(HeldRow(row, savepoint))


def _savepoint_rolled_back(session: Session, rolled_back: SessionTransaction) -> None:
    """A savepoint rolled back: the rows added inside it are no longer to be written."""
    queue = before_commit.queue(session)
    for events in (queue or {}).values():
        if isinstance(events, HeldBackEvents):
            events.held = [held for held in events.held if not held.undone_by(rolled_back)]
