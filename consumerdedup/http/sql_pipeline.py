"""Transactional mode on PostgreSQL and psycopg: two round trips fewer per request.

Left to itself, a transactional request waits on PostgreSQL five times: psycopg's own
BEGIN, the claim, the endpoint's writes, the response's UPDATE, the COMMIT; the bare
endpoint waits three times (BEGIN, its writes, COMMIT). Those waits, not the statements,
were most of what the middleware cost (docs/http.md). Here:

- the request's connection is taken in autocommit (``Session.connection(execution_options)``;
  SQLAlchemy restores the isolation level when the pool takes the connection back), so
  psycopg sends no BEGIN of its own, and ours goes out with the claim in one pipeline
  (psycopg's pipeline mode): one wait;
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

import contextlib
import functools
from collections.abc import Iterator, Mapping
from typing import Any

from sqlalchemy import Connection, Engine, event
from sqlalchemy.engine.interfaces import Dialect
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import TextClause
from sqlalchemy.sql.selectable import TextualSelect
from sqlalchemy.util import await_only

from ..errors import ConfigurationError

try:
    import psycopg
    from psycopg.rows import namedtuple_row
except ImportError:  # pragma: no cover - PostgreSQL is an extra
    psycopg = None  # type: ignore[assignment]

CONNECTION = "consumerdedup.http.pipelined"
"""Session.info: the connection a pipelined claim began its transaction on."""
BEGIN = "consumerdedup.http.begin"
"""Session.info: the BEGIN statement of a pipelined claim (the engine's isolation level)."""
_LEVELS = frozenset({"READ COMMITTED", "READ UNCOMMITTED", "REPEATABLE READ", "SERIALIZABLE"})
LOST = "consumerdedup: claim lost"
"""In the error the guarded UPDATE raises when the transaction no longer holds the claim."""


def take(session: Session) -> Connection | None:
    """The request's connection in autocommit, if this Session can take the pipelined path
    (a fresh Session on a psycopg Engine whose libpq has pipeline mode); else None."""
    if psycopg is None or session.in_transaction() or not psycopg.Pipeline.is_supported():
        return None
    bind = session.get_bind()
    if not isinstance(bind, Engine) or bind.dialect.driver != "psycopg":
        return None
    # In autocommit psycopg forgets the level the engine asked for (create_engine's or
    # execution_options' isolation_level): our BEGIN must name it, or a SERIALIZABLE
    # endpoint would silently run at the server's default.
    asked = bind.get_execution_options().get("isolation_level")
    if asked is not None and _level(asked) not in _LEVELS:
        return None  # AUTOCOMMIT (refused next) or a level we cannot name: the plain path
    conn = session.connection(execution_options={"isolation_level": "AUTOCOMMIT"})
    raw = conn.connection.driver_connection
    if not isinstance(raw, psycopg.BaseConnection):
        return None  # a creator= wrapper: dialects.require_driver refuses it next
    # create_engine's level: the dialect reads it at the first connect, which is done now.
    level = _level(asked or getattr(bind.dialect, "default_isolation_level", None))
    if level not in _LEVELS:
        raise ConfigurationError(
            f"the idempotency-key store: cannot tell the isolation level ({level!r}) the "
            "engine's transactions run at; give the engine an isolation_level"
        )
    words = ["BEGIN ISOLATION LEVEL", level]
    if raw.read_only is not None:  # postgresql_readonly: psycopg keeps it in autocommit
        words.append("READ ONLY" if raw.read_only else "READ WRITE")
    if raw.deferrable is not None:
        words.append("DEFERRABLE" if raw.deferrable else "NOT DEFERRABLE")
    session.info[CONNECTION] = conn
    session.info[BEGIN] = " ".join(words)
    return conn


def _level(name: object) -> str:
    return str(name or "").upper().replace("_", " ")


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


def ended(conn: Connection) -> bool:
    """The connection's transaction is over (psycopg's IDLE; no round trip)."""
    status = conn.connection.driver_connection.info.transaction_status  # type: ignore[union-attr]
    return int(status) == 0


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
    raw = conn.connection.driver_connection
    with _left_clean(conn):
        if isinstance(raw, psycopg.AsyncConnection):
            return await_only(_begin_async(raw, begin, sql, values))
        assert isinstance(raw, psycopg.Connection)
        with raw.pipeline():
            raw.execute(begin.encode())
            cursor = raw.cursor(row_factory=namedtuple_row)
            cursor.execute(sql, values)
        return cursor.fetchall()


@contextlib.contextmanager
def _left_clean(conn: Connection) -> Iterator[None]:
    """A driver error from our pipelines reaches the caller raw, past SQLAlchemy's own
    handling; at the commit SQLAlchemy then counts the transaction as over and gives the
    connection to the pool without a rollback. A connection left inside its transaction
    (aborted by an error the endpoint swallowed: a statement_timeout, an IntegrityError
    caught without a savepoint) cannot be reset, and one whose connection was lost (a
    killed backend, a restarted server) fails the Session's close: either stayed checked
    out forever, until every request waited on an empty pool. So the transaction is rolled
    back here, and a connection that is lost, broken, or does not roll back is invalidated
    (the pool discards it and opens a new one)."""
    try:
        yield
    except psycopg.Error as error:
        raw = conn.connection.driver_connection
        if error.sqlstate is None or raw is None or raw.closed or raw.broken:
            conn.invalidate(error)
        elif int(raw.info.transaction_status) != 0:  # not IDLE: roll it back
            try:
                if isinstance(raw, psycopg.AsyncConnection):
                    await_only(raw.rollback())
                else:
                    raw.rollback()
            except psycopg.Error:
                conn.invalidate(error)
        raise


async def _begin_async(raw: Any, begin: str, sql: str, values: Any) -> list[Any]:
    async with raw.pipeline():
        await raw.execute(begin.encode())
        cursor = raw.cursor(row_factory=namedtuple_row)
        await cursor.execute(sql, values)
    return await cursor.fetchall()  # type: ignore[no-any-return]


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
            with _left_clean(conn):
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
