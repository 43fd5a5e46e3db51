"""Outbox events a pipeline transaction holds back: key locks in hash order, then the rows.

See ``consumerdedup.db.before_commit``: inside a pipeline transaction on PostgreSQL
``Outbox.add`` queues a keyed event here instead of locking its key at once, so a
batch takes its keys' locks in one statement, in one order, just before COMMIT,
and two batches over the same keys wait on each other instead of deadlocking.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Integer, Table, TextualSelect, bindparam, insert, text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from ..db import locks
from ..db.names import table_sql


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


class HeldBackEvents:
    """One outbox table's held-back rows, in the order they were added."""

    def __init__(self, table: Table) -> None:
        self.lock = lock_keys(table)
        self.insert = insert(table)
        self.rows: list[dict[str, Any]] = []

    def _keys(self) -> dict[str, Any]:
        return {"keys": sorted({str(row["key"]) for row in self.rows})}

    def flush(self, session: Session) -> None:
        if self.rows:
            session.execute(self.lock, self._keys())
            session.execute(self.insert, self.rows)

    async def flush_async(self, session: AsyncSession) -> None:
        if self.rows:
            await session.execute(self.lock, self._keys())
            await session.execute(self.insert, self.rows)


def hold_back(held: dict[Any, Any], table: Table, row: dict[str, Any]) -> None:
    """Queue ``row`` for ``table`` in a transaction's open queue (``before_commit.queue``)."""
    events = held.setdefault(("outbox", table_sql(table)), HeldBackEvents(table))
    events.rows.append(row)
