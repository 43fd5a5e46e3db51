"""Our own statements on PostgreSQL, sent on the psycopg connection the session uses.

Why not through ``session.execute``: a claim is the pipeline's own fixed SQL, and
SQLAlchemy's per-statement work (a cache key, an execution context, a result
object) cost about as much CPU as psycopg's own (measured: 80 against 50 us a
claim). So the claim, the lookup and the records go to the driver connection
the session's transaction already holds, as text built once (``DriverSQL``).
Everything else (the handler's statements, COMMIT, ROLLBACK) stays SQLAlchemy's.

Not done: BEGIN and the claim in one round trip. psycopg's pipeline mode sends
its BEGIN with a Sync of its own and waits for it (``_start_query``), and the
claim's rows then need a second Sync: three round trips where plain execution
takes two (seen in a libpq trace). Sending BEGIN ourselves would mean driving
libpq under psycopg's feet; so a message costs four round trips (BEGIN, claim,
the handler's statement, COMMIT), as plain psycopg sending the same SQL does.

A driver error comes out as SQLAlchemy would raise it (``DBAPIError.instance``:
the same class, ``orig`` and ``connection_invalidated``), and a lost connection
is invalidated as SQLAlchemy would, so the retry rules and the pool see nothing
different. Any other statement (SQLite's, a partitioned table's) goes through
the session as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection
from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session


def _cursor(raw: Any) -> Any:
    """A cursor giving plain tuples, whatever row_factory the application set. (psycopg is
    imported here, not above: it is an extra, and SQLite never comes this way.)"""
    from psycopg.rows import tuple_row

    return raw.cursor(row_factory=tuple_row)


@dataclass(frozen=True, slots=True)
class DriverSQL:
    """A statement of ours as psycopg takes it: ``%(name)s`` parameters, built once."""

    text: str
    query: bytes = b""
    """``text`` encoded once (psycopg takes bytes as they are)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "query", self.text.encode())


def execute(session: Session, statement: Any, params: Any) -> Any:
    """Run one of our statements in the session's transaction; its rows (or Result)."""
    if not isinstance(statement, DriverSQL):
        return session.execute(statement, params)
    connection = session.connection()
    raw: Any = connection.connection.driver_connection
    cursor = _cursor(raw)
    try:
        cursor.execute(statement.query, params)
        return cursor.fetchall()
    except connection.dialect.loaded_dbapi.Error as exc:
        raise _translated(connection, statement, params, exc, cursor) from exc
    finally:
        cursor.close()


async def execute_async(session: AsyncSession, statement: Any, params: Any) -> Any:
    """``execute`` for an AsyncSession: awaited on the async psycopg connection itself."""
    if not isinstance(statement, DriverSQL):
        return await session.execute(statement, params)
    # The transaction's connection exists already (begin_checked ran): no I/O, no await.
    connection = session.sync_session.connection()
    raw: Any = connection.connection.driver_connection
    cursor = _cursor(raw)
    try:
        await cursor.execute(statement.query, params)
        return await cursor.fetchall()
    except connection.dialect.loaded_dbapi.Error as exc:
        raise _translated(connection, statement, params, exc, cursor) from exc
    finally:
        await cursor.close()


def _translated(
    connection: Connection, statement: DriverSQL, params: Any, error: Exception, cursor: Any
) -> sa_exc.StatementError:
    """``error`` as SQLAlchemy raises a driver error; a lost connection is invalidated."""
    dialect = connection.dialect
    lost = dialect.is_disconnect(error, connection.connection.dbapi_connection, cursor)  # type: ignore[arg-type]
    if lost and not connection.invalidated:
        connection.invalidate(error)
    return sa_exc.DBAPIError.instance(
        statement.text,
        params,
        error,
        dialect.loaded_dbapi.Error,
        hide_parameters=connection.engine.hide_parameters,
        connection_invalidated=lost,
        dialect=dialect,
    )
