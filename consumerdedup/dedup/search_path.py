"""Our records under the search_path the transaction had, whatever path a handler set.

Library tables named without a schema (``Tables.define()``'s default) resolve through
the search_path at each statement. A handler that changes it (``SET LOCAL search_path``,
a schema per tenant) would send check-first's record, written after the handler, to
another tenant's processed_events: its own message of that id then answered DUPLICATE,
and ours looked up where it is not, redelivered for ever.

On psycopg every statement of a handler call reaches the watched cursors (raw_commit)
before it is sent; on asyncpg SQLAlchemy's cursor events and asyncpg's watched methods
(asyncpg_watch) do the same. One that may change the path (db.control_sql.may_set_path: a SET or
RESET, a set_config call) is preceded by a read of the path in force (the transaction's).
Before a record statement of ours after that, the path is swapped back to it (one
statement: the handler's path read, the transaction's set), and before the next
statement that is not ours (the outbox's held-back events, which go to the outbox the
path named when they were added, or the next handler) the handler's path is set again.
A handler that sets nothing costs nothing; one that does, a statement or three.

Not seen: a path changed inside a function the handler calls, or below the cursors
(``pgconn.exec_``). Schema-qualified table names (``Tables.define("app.processed_events",
...)``) need none of this.
"""

from __future__ import annotations

from typing import Any

try:
    import psycopg
except ImportError:  # pragma: no cover - PostgreSQL is an extra
    psycopg = None  # type: ignore[assignment]
try:
    import asyncpg  # type: ignore[import-untyped]
except ImportError:  # pragma: no cover - asyncpg is an extra
    asyncpg = None

READ = b"SELECT current_setting('search_path')"
SWAP = b"SELECT current_setting('search_path'), set_config('search_path', %s, true)"
SET = b"SELECT set_config('search_path', %s, true)"


class PathKeeper:
    """One attempt's search_path: the transaction's, and the handlers' while ours run."""

    __slots__ = ("changed", "handlers", "ours", "path")

    def __init__(self) -> None:
        self.path: str | None = None
        """The transaction's path, read before the first statement that may change it."""
        self.changed = False
        """A handler's statement may have changed it since our last statement."""
        self.handlers: str | None = None
        """The handlers' path, while ours runs under the transaction's (set back next)."""
        self.ours = False
        """The next statement is a record of ours (``ours_next``)."""

    def before(self, may_set: bool) -> tuple[bytes, Any, bool] | None:
        """Before a statement (``may_set``: it may change the path): what to send first, as
        (query, parameters, whether its row is to be read), or None."""
        ours, self.ours = self.ours, False
        if ours:
            if self.changed and self.path is not None:
                self.changed = False
                return SWAP, (self.path,), True
            return None
        if self.handlers is not None:
            handlers, self.handlers = self.handlers, None
            self.changed = may_set
            return SET, (handlers,), False
        if may_set:
            self.changed = True
            if self.path is None:
                return READ, None, True
        return None

    def read(self, first: tuple[bytes, Any, bool], value: str) -> None:
        if first[0] is READ:
            self.path = value
        else:  # SWAP: the handlers' path, set back before the next statement not ours
            self.handlers = value


def send_first(cursor: Any, first: tuple[bytes, Any, bool]) -> Any:
    """Our statement ``first`` on a plain cursor of ``cursor``'s connection (never the
    handler's: a server-side cursor's execute would DECLARE); the path read, or None."""
    query, params, wanted = first
    ours = psycopg.Cursor(cursor.connection)
    try:
        ours.execute(query, params)
        row = ours.fetchone() if wanted else None
    finally:
        ours.close()
    return row[0] if row else None


async def send_first_asyncpg(raw: Any, first: tuple[bytes, Any, bool]) -> Any:
    """``send_first`` on asyncpg's own connection (``$1`` for ``%s``; asyncpg's own method,
    never the guard's watched one): the path read, or None."""
    query, params, wanted = first
    sql = query.decode().replace("%s", "$1")
    row = await asyncpg.Connection.fetchrow(raw, sql, *(params or ()))
    return row[0] if row and wanted else None


async def send_first_async(cursor: Any, first: tuple[bytes, Any, bool]) -> Any:
    """``send_first`` on an async connection."""
    query, params, wanted = first
    ours = psycopg.AsyncCursor(cursor.connection)
    try:
        await ours.execute(query, params)
        row = await ours.fetchone() if wanted else None
    finally:
        await ours.close()
    return row[0] if row else None
