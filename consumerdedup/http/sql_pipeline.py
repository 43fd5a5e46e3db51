"""Transactional mode on PostgreSQL and psycopg: two round trips fewer per request.

Left to itself, a transactional request waits on PostgreSQL five times: psycopg's own
BEGIN, the claim, the endpoint's writes, the response's UPDATE, the COMMIT; the bare
endpoint waits three times (BEGIN, its writes, COMMIT). Those waits, not the statements,
were most of what the middleware cost (docs/http.md). Here:

- the request's connection, begun as SQLAlchemy begins it, is switched to autocommit on
  the driver for that checkout only (db.pipelined_begin: switched back when the pool takes
  it back), so psycopg sends no BEGIN of its own, and ours, the one psycopg would have
  sent, goes out with the claim in one pipeline (psycopg's pipeline mode): one wait;
- the response's UPDATE goes out with the COMMIT in one pipeline, from the connection's
  commit event, after the Session's before_commit hooks and its last flush: one wait. The
  UPDATE raises when this transaction no longer holds the claim (the endpoint rolled
  back), and PostgreSQL skips the rest of a pipeline after an error, so the COMMIT behind
  it never commits what the endpoint wrote after its rollback.

In autocommit a statement outside a transaction would commit on its own, so while the
endpoint runs, transactional.hold_commits refuses any statement on the request's
connection once its transaction has ended behind the Session's back (``ended``).
Anything else (another driver, a Session already in a transaction or bound to a
Connection, a libpq without pipeline mode) takes the plain path in sql_session.py.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection, event
from sqlalchemy.engine.interfaces import Dialect
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import TextClause
from sqlalchemy.sql.selectable import TextualSelect
from sqlalchemy.util import await_only

from ..db import pipelined_begin

try:
    import psycopg
    from psycopg.rows import namedtuple_row
except ImportError:  # pragma: no cover - PostgreSQL is an extra
    psycopg = None  # type: ignore[assignment]

CONNECTION = "consumerdedup.http.pipelined"
"""Session.info: the connection a pipelined claim began its transaction on."""
BEGIN = "consumerdedup.http.begin"
"""Session.info: the BEGIN statement of a pipelined claim (the engine's isolation level)."""
LOST = "consumerdedup: claim lost"
"""In the error the guarded UPDATE raises when the transaction no longer holds the claim."""


def take(session: Session) -> Connection | None:
    """The request's connection in autocommit, if this Session can take the pipelined path
    (db.pipelined_begin.take); else None."""
    taken = pipelined_begin.take(session, "the idempotency-key store")
    if taken is None:
        return None
    conn, begin = taken
    session.info[CONNECTION] = conn
    session.info[BEGIN] = begin
    return conn


def begin_statement(session: Session) -> str:
    """The BEGIN that opens the pipelined transaction as psycopg would have (take())."""
    return str(session.info[BEGIN])


def held(session: Session) -> Connection | None:
    """The pipelined claim's connection, if it is still the session's transaction's."""
    conn = session.info.get(CONNECTION)
    if conn is None or not session.in_transaction() or session.connection() is not conn:
        return None
    return conn


def is_pipelined(session: Session) -> bool:
    return CONNECTION in session.info


ended = pipelined_begin.ended


@functools.lru_cache(maxsize=64)
def _compiled(statement: TextClause | TextualSelect, dialect: Dialect) -> Any:
    return statement.compile(dialect=dialect)


def _bound(
    conn: Connection, statement: TextClause | TextualSelect, params: Mapping[str, Any]
) -> tuple[str, Any]:
    compiled = _compiled(statement, conn.dialect)
    return compiled.string, compiled.construct_params(dict(params))


def begin_with(
    conn: Connection,
    begin: str,
    statement: TextClause | TextualSelect,
    params: Mapping[str, Any],
) -> list[Any]:
    """``begin`` and ``statement`` in one round trip; ``statement``'s rows (named tuples)."""
    sql, values = _bound(conn, statement, params)
    return pipelined_begin.first_statement(conn, begin, sql, values, namedtuple_row)


def commit_with(
    conn: Connection, statement: TextClause, params: Mapping[str, Any], lost: type[Exception]
) -> None:
    """At ``conn``'s commit, ``statement`` and COMMIT in one round trip; ``lost`` is raised
    (nothing committed) when ``statement`` finds the claim gone."""
    sql, values = _bound(conn, statement, params)
    armed = True

    def commit(_: Connection) -> None:
        nonlocal armed
        if not armed:  # the request's connection commits once; never store twice
            return
        armed = False
        raw = conn.connection.driver_connection
        try:
            with pipelined_begin.left_clean(conn):
                _commit_in_pipeline(raw, sql, values)
        except psycopg.Error as error:
            if LOST in str(error):
                raise lost(
                    "the idempotency-key store: the request's transaction no longer holds "
                    "its claim (did the endpoint roll the request's session back? that ends "
                    "the transaction the claim lived in); nothing is committed"
                ) from None
            raise

    event.listen(conn, "commit", commit)


def _commit_in_pipeline(raw: Any, sql: str, values: Any) -> None:
    if isinstance(raw, psycopg.AsyncConnection):
        await_only(_commit_async(raw, sql, values))
        return
    assert isinstance(raw, psycopg.Connection)
    with raw.pipeline():
        raw.execute(sql, values)
        raw.execute("COMMIT")


async def _commit_async(raw: Any, sql: str, values: Any) -> None:
    async with raw.pipeline():
        await raw.execute(sql, values)
        await raw.execute("COMMIT")  # not commit(): it syncs, and leaving the pipeline again
