"""BEGIN and a transaction's first statement in one round trip, on psycopg.

Left to itself psycopg sends its own BEGIN before a transaction's first statement and
waits for it (in pipeline mode too: ``_start_query`` syncs after it), so every
transaction waits on PostgreSQL once more than it sends statements. Here the
session's connection is taken in autocommit (``Session.connection(execution_options)``:
SQLAlchemy restores the isolation level when the pool takes the connection back), so
psycopg sends no BEGIN of its own, and ours, naming the level, READ ONLY and
DEFERRABLE as psycopg would have, goes out with the first statement in one pipeline.

In autocommit a statement outside a transaction commits on its own. So whoever takes
this path sends nothing on the connection once its transaction has ended behind the
Session's back (the handler guard and the HTTP middleware refuse such statements;
``ended`` says so without a round trip), and rolls back on the driver before the
Session lets the connection go (``roll_back_held``): SQLAlchemy restores autocommit's
isolation level at checkin, which psycopg refuses inside a transaction, and the
connection would stay checked out for good. Used by the HTTP middleware's transactional
claim (http/sql_pipeline.py) and the pipeline's claim (dedup/driver_sql.py).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

from sqlalchemy import Connection, Engine, event
from sqlalchemy.orm import Session
from sqlalchemy.util import await_only

from ..errors import ConfigurationError
from . import dialects

try:
    import psycopg
except ImportError:  # pragma: no cover - PostgreSQL is an extra
    psycopg = None  # type: ignore[assignment]

_LEVELS = frozenset({"READ COMMITTED", "READ UNCOMMITTED", "REPEATABLE READ", "SERIALIZABLE"})
_AS_CHECKED_OUT = "consumerdedup.driver_autocommit"
"""In a connection's ``info``: whether its driver was in autocommit when it was checked out
(before execution options applied), noted by ``note_autocommit`` on engines we own."""
_noting: weakref.WeakSet[Engine] = weakref.WeakSet()


def note_autocommit(engine: Engine) -> None:
    """On an engine of ours (a deduplicator's engine copy): note at each checkout whether the
    driver itself is in autocommit (``connect_args={"autocommit": True}``), which taking the
    connection in autocommit would hide; ``take(..., own=True)`` needs it."""
    if engine not in _noting:
        event.listen(engine, "engine_connect", _note)
        _noting.add(engine)


def _note(conn: Connection) -> None:
    raw = conn.connection.driver_connection
    conn.info[_AS_CHECKED_OUT] = getattr(raw, "autocommit", None)


def take(session: Session, what: str, own: bool = False) -> tuple[Connection, str] | None:
    """The session's connection in autocommit, and the BEGIN that opens its transaction,
    if this Session can take the pipelined path (a fresh Session on a psycopg Engine whose
    libpq has pipeline mode); else None, and nothing is done. ``own``: only on an engine
    that notes its drivers' autocommit (note_autocommit), and a connection whose driver
    was in autocommit already is refused (ConfigurationError) and discarded: the pool
    would give it back out of autocommit, to the application's code."""
    if psycopg is None or session.in_transaction() or not psycopg.Pipeline.is_supported():
        return None
    bind = session.get_bind()
    if not isinstance(bind, Engine) or bind.dialect.driver != "psycopg":
        return None
    if own and bind not in _noting:
        return None
    # In autocommit psycopg forgets the level the engine asked for (create_engine's or
    # execution_options' isolation_level): our BEGIN must name it, or a SERIALIZABLE
    # transaction would silently run at the server's default.
    asked = bind.get_execution_options().get("isolation_level")
    if asked is not None and _level(asked) not in _LEVELS:
        return None  # AUTOCOMMIT (refused next by the caller's checks) or a level unnamed
    conn = session.connection(execution_options={"isolation_level": "AUTOCOMMIT"})
    raw = conn.connection.driver_connection
    if not isinstance(raw, psycopg.BaseConnection):
        return None  # a creator= wrapper: dialects.require_driver refuses it next
    if own and conn.info.get(_AS_CHECKED_OUT) is not False:
        error = ConfigurationError(dialects.autocommit_message(what))
        conn.invalidate(error)
        raise error
    # create_engine's level: the dialect reads it at the first connect, which is done now.
    level = _level(asked or getattr(bind.dialect, "default_isolation_level", None))
    if level not in _LEVELS:
        raise ConfigurationError(
            f"{what}: cannot tell the isolation level ({level!r}) the engine's transactions "
            "run at; give the engine an isolation_level"
        )
    words = ["BEGIN ISOLATION LEVEL", level]
    if raw.read_only is not None:  # postgresql_readonly: psycopg keeps it in autocommit
        words.append("READ ONLY" if raw.read_only else "READ WRITE")
    if raw.deferrable is not None:
        words.append("DEFERRABLE" if raw.deferrable else "NOT DEFERRABLE")
    return conn, " ".join(words)


def _level(name: object) -> str:
    return str(name or "").upper().replace("_", " ")


def ended(conn: Connection) -> bool:
    """The connection's transaction is over (psycopg's IDLE; no round trip)."""
    status = conn.connection.driver_connection.info.transaction_status  # type: ignore[union-attr]
    return int(status) == 0


def first_statement(
    conn: Connection, begin: str, sql: str | bytes, values: Any, row_factory: Any
) -> list[Any]:
    """``begin`` and ``sql`` in one round trip; ``sql``'s rows, made by ``row_factory``."""
    raw = conn.connection.driver_connection
    with left_clean(conn):
        if isinstance(raw, psycopg.AsyncConnection):
            return await_only(_first_async(raw, begin, sql, values, row_factory))
        assert isinstance(raw, psycopg.Connection)
        with raw.pipeline():
            raw.execute(begin.encode())
            cursor = raw.cursor(row_factory=row_factory)
            cursor.execute(sql, values)
        try:
            return cursor.fetchall()
        finally:
            cursor.close()


async def first_statement_async(
    conn: Connection, begin: str, sql: str | bytes, values: Any, row_factory: Any
) -> list[Any]:
    """``first_statement`` awaited on an AsyncConnection (no greenlet switch)."""
    raw: Any = conn.connection.driver_connection
    try:
        return await _first_async(raw, begin, sql, values, row_factory)
    except psycopg.Error as error:
        await _clean_async(conn, raw, error)
        raise


async def _first_async(raw: Any, begin: str, sql: str | bytes, values: Any, rows: Any) -> list[Any]:
    async with raw.pipeline():
        await raw.execute(begin.encode())
        cursor = raw.cursor(row_factory=rows)
        await cursor.execute(sql, values)
    try:
        return await cursor.fetchall()  # type: ignore[no-any-return]
    finally:
        await cursor.close()


@contextlib.contextmanager
def left_clean(conn: Connection) -> Iterator[None]:
    """A driver error from our pipelines reaches the caller raw, past SQLAlchemy's own
    handling; at the commit SQLAlchemy then counts the transaction as over and gives the
    connection to the pool without a rollback. A connection left inside its transaction
    (aborted by an error the caller swallowed: a statement_timeout, an IntegrityError
    caught without a savepoint) cannot be reset, and one whose connection was lost (a
    killed backend, a restarted server) fails the Session's close: either stayed checked
    out forever, until every caller waited on an empty pool. So the transaction is rolled
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


async def _clean_async(conn: Connection, raw: Any, error: Any) -> None:
    if error.sqlstate is None or raw is None or raw.closed or raw.broken:
        conn.invalidate(error)
    elif int(raw.info.transaction_status) != 0:
        try:
            await raw.rollback()
        except psycopg.Error:
            conn.invalidate(error)


def roll_back_held(session: Session, conn: Connection) -> None:
    """Before the Session lets ``conn`` go: a transaction still open on the driver (one
    SQLAlchemy counts as over) is rolled back there, so that the pool can restore
    ``conn``'s isolation level; a connection that cannot is invalidated. Only while the
    session still holds ``conn``: once given back, it may be someone else's."""
    if _holds(session, conn) and not ended(conn):
        raw: Any = conn.connection.driver_connection
        try:
            raw.rollback()
        except psycopg.Error as error:
            conn.invalidate(error)


async def roll_back_held_async(session: Session, conn: Connection) -> None:
    """``roll_back_held`` for an AsyncSession's sync_session and connection."""
    if _holds(session, conn) and not ended(conn):
        raw: Any = conn.connection.driver_connection
        try:
            await raw.rollback()
        except psycopg.Error as error:
            conn.invalidate(error)


def _holds(session: Session, conn: Connection) -> bool:
    """The session's transaction still uses ``conn`` (no I/O: the transaction has it)."""
    if conn.closed or conn.invalidated or not session.in_transaction():
        return False
    transaction: Any = session.get_transaction()
    if transaction is None:
        return False
    held = getattr(transaction, "connections", None)
    if held is None:  # SQLAlchemy 2.0: no public attribute yet
        held = {connection for connection, *_ in transaction._connections.values()}
    return conn in held
