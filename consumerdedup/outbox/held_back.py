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

import weakref
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Integer, Table, TextualSelect, bindparam, event, insert, text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session, SessionTransaction
from sqlalchemy.sql.elements import (
    ReleaseSavepointClause,
    RollbackToSavepointClause,
    SavepointClause,
)

from ..db import before_commit, locks
from ..db.control_sql import savepoint_command
from ..db.names import table_sql
from ..errors import ConfigurationError, RetryLater

_WATCHED = "consumerdedup.outbox_savepoints"
"""session.info: the savepoint rollback listener is on this session."""
_SQL_WATCHED = "consumerdedup.outbox_savepoint_sql"
"""connection.info: the session whose held rows this connection's savepoint SQL concerns."""
_TRACK = ("~savepoints",)
"""In a transaction's queue: the savepoints (SQLAlchemy's own) its statements opened."""
_SEARCH_PATH = (
    "the handler changed search_path while keyed outbox events of an unqualified outbox "
    "table were held back to COMMIT (they would go to the table the new path names); "
    "tried again in a transaction of its own; qualify the outbox table to avoid the retry"
)
_RAW_SAVEPOINT = (
    "a keyed Outbox.add is held back until just before the pipeline's COMMIT, so a savepoint "
    "sent as SQL cannot undo it: use session.begin_nested() (or Connection.begin_nested()) "
    "in a handler that adds keyed outbox events"
)


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
    under: tuple[str, ...] = ()
    """The SQL savepoints (``SavepointTrack``) open when it was added."""

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
        self.table = table
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
    if before_commit.below(held):
        raise ConfigurationError(before_commit.BELOW_MESSAGE)
    track = _track(held, session)
    events = held.setdefault(("outbox", table_sql(table)), HeldBackEvents(table))
    savepoint = session.get_nested_transaction()
    if savepoint is not None and not session.info.get(_WATCHED):
        session.info[_WATCHED] = True
        event.listen(session, "after_soft_rollback", _savepoint_rolled_back)
    events.held.append(HeldRow(row, savepoint, tuple(track.open)))


class SavepointTrack:
    """The savepoints a transaction's connection opened, seen as the statements they are.

    ``after_soft_rollback`` sees only the session's own ``begin_nested()``; a
    ``Connection.begin_nested()`` or a savepoint sent as SQL would leave its held rows to
    be written at COMMIT though their savepoint was rolled back. Every SAVEPOINT,
    RELEASE and ROLLBACK TO SQLAlchemy sends is seen here with its name; one sent as SQL
    cannot be followed by name, and is refused (fails closed) once keyed rows are held.
    """

    def __init__(self) -> None:
        self.open: list[str] = []
        self.raw = False
        self.path_before: Any = None
        """The search_path read before a statement that may change it (None: no such)."""
        self.sending: str | None = None
        """The statement SQLAlchemy is sending (its listeners compare the path around it)."""

    def path_may_change(self, queue: dict[Any, Any], sql: str) -> None:
        """``sql`` may change search_path and reached the driver's cursor without SQLAlchemy
        (the raw connection): the path cannot be compared around it, so with keyed rows of
        an unqualified outbox held, the message goes again alone (fails closed)."""
        if sql != self.sending and _unqualified_held(queue):
            raise RetryLater(_SEARCH_PATH)

    def flush(self, session: Session) -> None:
        """Nothing to write (a queue entry, so it lives exactly as long as the queue)."""

    async def flush_async(self, session: AsyncSession) -> None:
        """Nothing to write."""

    def rolled_back(self, name: str, queue: dict[Any, Any]) -> None:
        # A name we never saw was opened before the first held row: all of them are inside it.
        known = name in self.open
        if known:
            del self.open[self.open.index(name) :]
        for events in queue.values():
            if isinstance(events, HeldBackEvents):
                events.held = [h for h in events.held if known and name not in h.under]


def _track(held: dict[Any, Any], session: Session) -> SavepointTrack:
    track = held.get(_TRACK)
    if not isinstance(track, SavepointTrack):
        track = held[_TRACK] = SavepointTrack()
    if track.raw:
        raise ConfigurationError(_RAW_SAVEPOINT)
    connection = session.connection()
    # On the Connection object (one per checkout), not its info (the pooled connection's).
    if not event.contains(connection, "after_cursor_execute", _statement_ran):
        event.listen(connection, "before_cursor_execute", _statement_starts)
        event.listen(connection, "after_cursor_execute", _statement_ran)
    connection.info[_SQL_WATCHED] = weakref.ref(session)
    return track


def _tracked(connection: Connection) -> tuple[dict[Any, Any], SavepointTrack] | None:
    owner = connection.info.get(_SQL_WATCHED)
    session = owner() if owner is not None else None
    queue = before_commit.queue(session) if session is not None else None
    track = queue.get(_TRACK) if queue is not None else None
    return (queue, track) if queue is not None and isinstance(track, SavepointTrack) else None


def _unqualified_held(queue: dict[Any, Any]) -> bool:
    return any(
        isinstance(e, HeldBackEvents) and e.held and e.table.schema is None for e in queue.values()
    )


def _search_path(connection: Connection) -> Any:
    """The path in force, read on a DB-API cursor of its own (no SQLAlchemy event fires)."""
    cursor = connection.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    try:
        cursor.execute("SELECT current_setting('search_path')")
        return cursor.fetchone()
    finally:
        cursor.close()


def _statement_starts(connection: Connection, _cursor: Any, statement: str, *_: Any) -> None:
    tracked = _tracked(connection)
    if tracked:
        tracked[1].sending = statement
    if tracked and "SEARCH_PATH" in statement.upper() and _unqualified_held(tracked[0]):
        tracked[1].path_before = _search_path(connection)


def _statement_ran(
    connection: Connection,
    _cursor: Any,
    statement: str,
    _parameters: Any,
    context: Any,
    _executemany: bool,
) -> None:
    tracked = _tracked(connection)
    if tracked is None:
        return
    queue, track = tracked
    track.sending = None
    compiled = getattr(context, "compiled", None)
    clause = getattr(compiled, "statement", None)
    if isinstance(clause, SavepointClause):
        track.open.append(str(clause.ident))
    elif isinstance(clause, RollbackToSavepointClause):
        track.rolled_back(str(clause.ident), queue)
    elif isinstance(clause, ReleaseSavepointClause):
        name = str(clause.ident)
        if name in track.open:
            del track.open[track.open.index(name) :]
    elif savepoint_command(statement, connection.dialect.name):
        track.raw = True
        if any(isinstance(e, HeldBackEvents) and e.held for e in queue.values()):
            raise ConfigurationError(_RAW_SAVEPOINT)
    elif track.path_before is not None:
        before, track.path_before = track.path_before, None
        if _search_path(connection) != before:
            # The held rows' unqualified table would resolve under the new path at COMMIT
            # (another tenant's outbox): this message goes again in a transaction of its
            # own, after the batch-mates that held them have committed.
            raise RetryLater(_SEARCH_PATH)


def _savepoint_rolled_back(session: Session, rolled_back: SessionTransaction) -> None:
    """A savepoint rolled back: the rows added inside it are no longer to be written."""
    queue = before_commit.queue(session)
    for events in (queue or {}).values():
        if isinstance(events, HeldBackEvents):
            events.held = [held for held in events.held if not held.undone_by(rolled_back)]
