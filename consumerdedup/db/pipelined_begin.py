"""BEGIN and a transaction's first statement in one round trip, on psycopg.

Left to itself psycopg sends its own BEGIN before a transaction's first statement and
waits for it (in pipeline mode too: ``_start_query`` syncs after it), so every
transaction waits on PostgreSQL once more than it sends statements. Here the
session's connection, begun as SQLAlchemy begins it, is switched to autocommit on the
driver for that checkout (``take``: switched back when the pool takes it back), so
psycopg sends no BEGIN of its own, and ours, the very BEGIN psycopg would have sent
(``start_command``), goes out with the first statement in one pipeline.

In autocommit a statement outside a transaction commits on its own. So whoever takes
this path sends nothing on the connection once its transaction has ended behind the
Session's back (the handler guard and the HTTP middleware refuse such statements;
``ended`` says so without a round trip), and rolls back on the driver before the
Session lets the connection go (``roll_back_held``): a transaction SQLAlchemy counts as
over gets no rollback from the pool, and leaving autocommit at checkin rolls it back
first (or discards the connection). Used by the HTTP middleware's transactional
claim (http/sql_pipeline.py) and the pipeline's claim (dedup/driver_sql.py).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session
from sqlalchemy.util import await_only

from ..errors import ConfigurationError
from . import dialects

try:
    import psycopg
except ImportError:  # pragma: no cover - PostgreSQL is an extra
    psycopg = None  # type: ignore[assignment]

_LEVELS = frozenset({"READ COMMITTED", "READ UNCOMMITTED", "REPEATABLE READ", "SERIALIZABLE"})
_IDLE = 0
_ours: weakref.WeakSet[Engine] = weakref.WeakSet()
"""Engines of ours (a deduplicator's engine copy): ``take(..., own=True)`` runs only on them."""


def mark_ours(engine: Engine) -> None:
    """``engine`` is one of ours (a deduplicator's engine copy): ``take(..., own=True)`` may
    take its connections, and refuses one whose driver is in autocommit already
    (``connect_args={"autocommit": True}``)."""
    _ours.add(engine)


def take(session: Session, what: str, own: bool = False) -> tuple[Connection, str] | None:
    """The session's connection in autocommit, and the BEGIN that opens its transaction,
    if this Session can take the pipelined path (a fresh Session on a psycopg Engine whose
    libpq has pipeline mode); else None, and nothing is done. ``own``: only on an engine
    of ours (mark_ours), and a connection whose driver is in autocommit already is
    refused (ConfigurationError), left as it is.

    The connection is begun as SQLAlchemy begins it (``session.connection()``: the
    engine's execution options applied, the application's ``begin`` and ``after_begin``
    listeners run, on a driver not in autocommit), and only then is the driver switched
    to autocommit, for this checkout only. Not through SQLAlchemy's
    ``isolation_level="AUTOCOMMIT"``: that ran the application's ``begin`` listeners in
    autocommit (a ``SET LOCAL`` lost, an audit INSERT committed alone), and its reset at
    checkin set the driver to the dialect's default level, not the one the application
    gave it (a ``connect`` listener's, ``SET SESSION CHARACTERISTICS``). A listener that
    sent a statement has begun the transaction already: then the plain path (None)."""
    if psycopg is None or session.in_transaction() or not psycopg.Pipeline.is_supported():
        return None
    bind = session.get_bind()
    if not isinstance(bind, Engine) or bind.dialect.driver != "psycopg":
        return None
    if own and bind not in _ours:
        return None
    asked = bind.get_execution_options().get("isolation_level")
    if asked is not None and _level(asked) not in _LEVELS:
        return None  # AUTOCOMMIT (refused next by the caller's checks) or a level unnamed
    conn = session.connection()
    raw = conn.connection.driver_connection
    if not isinstance(raw, psycopg.BaseConnection):
        return None  # a creator= wrapper: dialects.require_driver refuses it next
    if raw.autocommit:
        if own:
            raise ConfigurationError(dialects.autocommit_message(what))
        return None  # the caller's checks refuse it, the connection left as it is
    if int(raw.pgconn.transaction_status) != _IDLE:
        return None  # a begin listener's statement began the transaction: nothing to pipeline
    if _idle_bound(conn):
        return None  # the pipeline would leave the server's idle timer unarmed (_idle_bound)
    begin = start_command(raw)
    _autocommit_for_this_checkout(conn, raw)
    return conn, begin


_IDLE_BOUND = "consumerdedup.idle_in_transaction_bound"
"""In the pooled connection's ``info``: its idle_in_transaction_session_timeout is set."""


def _idle_bound(conn: Connection) -> bool:
    """The connection's server session bounds an idle transaction
    (idle_in_transaction_session_timeout > 0: a role's, the database's, a connect option's).

    Then its transactions begin the plain way, one round trip more: psycopg ends a
    pipeline with a Sync and then a Flush, and PostgreSQL arms the idle timer at the Sync
    and disarms it at the Flush, arming it again only after the next statement. A handler
    stuck before its first statement would never be ended by the bound, and a twin would
    wait on its claim as long as it hangs. Read once per connection (a catalog read and a
    rollback, on its first checkout that could pipeline), kept in its pool record's info:
    a SET of the setting on a pooled connection later is not seen."""
    info = conn.connection.info
    bound = info.get(_IDLE_BOUND)
    if bound is None:
        dbapi: Any = conn.connection.dbapi_connection  # the async adapter awaits for us
        try:
            cursor = dbapi.cursor()
            try:
                cursor.execute(_IDLE_BOUND_SQL)
                row = cursor.fetchone()
            finally:
                cursor.close()
                dbapi.rollback()  # as it was: no transaction open
        except psycopg.OperationalError as exc:
            # Sent on the driver's connection, below SQLAlchemy: a connection killed here
            # (an outage, a failover) is the database's absence, retried as any other, never
            # the setup fault an unwrapped driver error would be taken for (begin_checked).
            raise sa_exc.OperationalError(_IDLE_BOUND_SQL, None, exc) from exc
        bound = info[_IDLE_BOUND] = bool(row and row[0])
    return bool(bound)


_IDLE_BOUND_SQL = (
    "SELECT setting::bigint > 0 FROM pg_settings WHERE name = 'idle_in_transaction_session_timeout'"
)


def start_command(raw: Any) -> str:
    """The BEGIN psycopg itself would send on ``raw`` (its ``_get_tx_start_command``): the
    connection's own isolation_level, read_only and deferrable, whoever set them (the
    engine's isolation_level or execution options, a connect listener, a creator=); with
    none, a plain BEGIN, so the server's default (``SET SESSION CHARACTERISTICS``,
    ``default_transaction_isolation``) applies as it does to the application's own."""
    words = ["BEGIN"]
    if raw.isolation_level is not None:
        words += ["ISOLATION LEVEL", psycopg.IsolationLevel(raw.isolation_level).name]
    if raw.read_only is not None:
        words.append("READ ONLY" if raw.read_only else "READ WRITE")
    if raw.deferrable is not None:
        words.append("DEFERRABLE" if raw.deferrable else "NOT DEFERRABLE")
    return " ".join(words).replace("_", " ")


def _autocommit_for_this_checkout(conn: Connection, raw: Any) -> None:
    """``raw`` in autocommit until the pool takes it back: then, after the pool's reset
    (its rollback), out of autocommit again, rolled back first if a transaction is still
    open; a connection that cannot be given back so is invalidated (the pool opens a new
    one), never handed to the application in autocommit. On the connection record's
    finalize callbacks, where SQLAlchemy's own connection characteristics are undone."""
    fairy: Any = conn.connection
    record = fairy._connection_record
    dbapi = fairy.dbapi_connection  # the async adapter awaits set_autocommit in its setter

    def restore(_: Any) -> None:
        try:
            if int(raw.pgconn.transaction_status) != _IDLE:
                dbapi.rollback()
            dbapi.autocommit = False
            if raw.autocommit:  # pragma: no cover - psycopg raises rather than ignore it
                raise ConfigurationError("the driver stayed in autocommit")
        except Exception as error:
            try:
                record.invalidate(error)
            except Exception:  # pragma: no cover - closing failed too: the socket goes
                raw.pgconn.finish()

    dbapi.autocommit = True
    record.finalize_callback.append(restore)


def _level(name: object) -> str:
    return str(name or "").upper().replace("_", " ")


def ended(conn: Connection) -> bool:
    """The connection's transaction is over (psycopg's IDLE; no round trip)."""
    status = conn.connection.driver_connection.pgconn.transaction_status  # type: ignore[union-attr]
    return int(status) == _IDLE


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
        raw: Any = conn.connection.driver_connection
        if _lost(raw, error):
            conn.invalidate(error)
        elif int(raw.pgconn.transaction_status) != _IDLE:  # roll it back
            try:
                if isinstance(raw, psycopg.AsyncConnection):
                    await_only(raw.rollback())
                else:
                    raw.rollback()
            except psycopg.Error:
                conn.invalidate(error)
        raise


def _lost(raw: Any, error: Any) -> bool:
    """The error left no connection to roll back on: no SQLSTATE (the driver's own
    failure), or the connection closed or broken."""
    return bool(error.sqlstate is None or raw is None or raw.closed or raw.broken)


async def _clean_async(conn: Connection, raw: Any, error: Any) -> None:
    """``left_clean`` awaited: the same rule."""
    if _lost(raw, error):
        conn.invalidate(error)
    elif int(raw.pgconn.transaction_status) != _IDLE:
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
