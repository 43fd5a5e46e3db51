"""Our own statements on PostgreSQL, sent on the psycopg connection the session uses.

Why not through ``session.execute``: a claim is the pipeline's own fixed SQL, and
SQLAlchemy's per-statement work (a cache key, an execution context, a result
object) cost about as much CPU as psycopg's own (measured: 80 against 50 us a
claim). So the claim, the lookup and the records go to the driver connection
the session's transaction already holds, as text built once (``DriverSQL``).
Everything else (the handler's statements, COMMIT, ROLLBACK) stays SQLAlchemy's.

The transaction's first statement (the claim, or check-first's lookup) goes out with
its BEGIN in one pipeline (db/pipelined_begin.py, set up by transaction_start): a
message costs three round trips (BEGIN and the claim, the handler's statement,
COMMIT), as the handler's statement alone does. The connection is then in
autocommit, so a statement of ours finding the transaction over (IDLE) would commit
alone: refused (TransactionBroken), whoever ended it.

A driver error comes out as SQLAlchemy would raise it (``DBAPIError.instance``:
the same class, ``orig`` and ``connection_invalidated``), and a lost connection
is invalidated as SQLAlchemy would, so the retry rules and the pool see nothing
different. Any other statement (SQLite's, a partitioned table's) goes through
the session as before.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from sqlalchemy import TextClause, text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from ..db import pipelined_begin
from ..db.direct import translated, tuple_rows
from ..errors import TransactionBroken
from . import mysql_claim
from .handler_guard import ours_next
from .ops import Execute, Op
from .transaction_start import PENDING_BEGIN

_ENDED = (
    "the transaction ended before a statement of the pipeline's (in autocommit it would "
    "commit alone): nothing of it is sent"
)


def _open(raw: Any) -> None:
    """Fail closed: in autocommit (the pipelined BEGIN) an IDLE connection has no
    transaction for our statement."""
    if raw.autocommit and int(raw.pgconn.transaction_status) == 0:
        raise TransactionBroken(_ENDED)


@dataclass(frozen=True, slots=True)
class DriverSQL:
    """A statement of ours as psycopg takes it: ``%(name)s`` parameters, built once."""

    text: str
    query: bytes = b""
    """``text`` encoded once (psycopg takes bytes as they are)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "query", self.text.encode())


_PYFORMAT = re.compile(r"%\((\w+)\)s")
_CAST = re.compile(r"%\((\w+)\)s::([\w\[\]]+)")
"""``%(keys)s::text[]``: SQLAlchemy's text() reads no parameter before ``::``."""
_portables: dict[str, TextClause] = {}


def _portable(statement: DriverSQL) -> TextClause:
    """``statement`` as SQLAlchemy's text (``:name`` parameters), for asyncpg: the same SQL,
    the keys as arrays, one statement whatever the batch's size. Built once."""
    clause = _portables.get(statement.text)
    if clause is None:
        sql = _PYFORMAT.sub(r":\1", _CAST.sub(r"CAST(:\1 AS \2)", statement.text))
        clause = _portables[statement.text] = text(sql)
    return clause


def sent_first(op: Op) -> bool:
    """The attempt's first operation is a statement of ours sent here (its BEGIN may go
    with it: transaction_start); anything else begins the plain way."""
    return isinstance(op, Execute) and isinstance(op.statement, DriverSQL)


def execute(session: Session, statement: Any, params: Any) -> Any:
    """Run one of our statements in the session's transaction; its rows (or Result)."""
    ours_next(session)  # under the transaction's search_path, whatever a handler set
    if isinstance(statement, mysql_claim.MySQLStatement):  # MySQL's claim and its check
        return mysql_claim.run(session, statement, params)
    if not isinstance(statement, DriverSQL):
        return session.execute(statement, params)
    connection = session.connection()
    raw: Any = connection.connection.driver_connection
    begin = session.info.pop(PENDING_BEGIN, None)
    if begin is not None:
        try:
            return pipelined_begin.first_statement(
                connection, begin, statement.query, params, tuple_rows()
            )
        except connection.dialect.loaded_dbapi.Error as exc:
            raise translated(connection, statement.text, params, exc, None) from exc
    _open(raw)
    cursor = raw.cursor(row_factory=tuple_rows())
    try:
        cursor.execute(statement.query, params)
        return cursor.fetchall()
    except connection.dialect.loaded_dbapi.Error as exc:
        raise translated(connection, statement.text, params, exc, cursor) from exc
    finally:
        cursor.close()


async def execute_async(session: AsyncSession, statement: Any, params: Any) -> Any:
    """``execute`` for an AsyncSession: awaited on the async psycopg connection itself."""
    ours_next(session.sync_session)
    if isinstance(statement, mysql_claim.MySQLStatement):  # MySQL's claim and its check
        return await mysql_claim.run_async(session, statement, params)
    if not isinstance(statement, DriverSQL):
        return await session.execute(statement, params)
    # The transaction's connection exists already (begin_checked ran): no I/O, no await.
    connection = session.sync_session.connection()
    raw: Any = connection.connection.driver_connection
    if connection.dialect.driver == "asyncpg":  # its adapter holds the transaction: through it
        return (await session.execute(_portable(statement), params)).all()
    begin = session.sync_session.info.pop(PENDING_BEGIN, None)
    if begin is not None:
        try:
            return await pipelined_begin.first_statement_async(
                connection, begin, statement.query, params, tuple_rows()
            )
        except connection.dialect.loaded_dbapi.Error as exc:
            raise translated(connection, statement.text, params, exc, None) from exc
    _open(raw)
    cursor = raw.cursor(row_factory=tuple_rows())
    try:
        await cursor.execute(statement.query, params)
        return await cursor.fetchall()
    except connection.dialect.loaded_dbapi.Error as exc:
        raise translated(connection, statement.text, params, exc, cursor) from exc
    finally:
        await cursor.close()
