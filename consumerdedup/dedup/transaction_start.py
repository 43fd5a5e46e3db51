"""What must hold before the pipeline's first statement in a session: a real transaction,
the session's own, on a supported driver; shared by both deduplicators.

On psycopg the transaction's BEGIN goes out with our first statement, in one round
trip (db/pipelined_begin.py): ``begin_checked`` takes the connection in autocommit and
leaves the BEGIN in ``session.info`` for driver_sql to send; the drivers call
``release`` before the session lets the connection go.
"""

from __future__ import annotations

from sqlalchemy import Connection
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from ..db import dialects, pipelined_begin, sqlite
from ..errors import AuthenticationFailed, ConfigurationError, TransactionBroken
from ..reasons import authentication_refused, describe
from .driver_state import ABORTED, ENDED, OPEN, driver_state
from .handler_guard import end_calls

_MAY_PASS = (
    sa_exc.DBAPIError,
    sa_exc.TimeoutError,
    sa_exc.DisconnectionError,
    OSError,
    ConfigurationError,
)
"""What beginning a transaction may raise for reasons that pass: the retry policy's to judge."""
PENDING_BEGIN = "consumerdedup.pending_begin"
"""In ``session.info``: the BEGIN driver_sql sends with our first statement."""
AUTOCOMMIT_CONNECTION = "consumerdedup.autocommit_connection"
"""In ``session.info``: the connection taken in autocommit for that (``release``)."""


def begin_checked(session: Session, what: str, pipelined: bool = False) -> None:
    """Before our first statement, on the connection the session really uses: a real
    transaction (BEGIN IMMEDIATE on SQLite), on a supported driver, not in autocommit,
    and the session's own (its commit is the database's). ``pipelined``: the first
    statement is one of ours driver_sql sends, so on psycopg the BEGIN may go with it."""
    if session.twophase:  # PREPARE TRANSACTION at our COMMIT: a crash there holds the claims
        raise ConfigurationError(
            f"{what}: the session factory gives two-phase sessions (twophase=True); our "
            "commit must be a plain COMMIT (a prepared transaction left by a crash would hold "
            "its claims' locks until resolved by hand); use a session factory without twophase"
        )
    bind = session.get_bind()
    if isinstance(bind, Connection) and bind.in_transaction() and not session.in_transaction():
        raise ConfigurationError(
            f"{what}: the session factory gave a session bound to a Connection already in a "
            "transaction; the session would join it, and its commit would commit nothing "
            "(PROCESSED would be reported for work the caller may still roll back); give "
            "sessions bound to an engine, or to a connection not in a transaction"
        )
    try:
        taken = pipelined_begin.take(session, what, own=True) if pipelined else None
        connection = session.connection() if taken is None else taken[0]
    except sa_exc.DBAPIError as exc:
        if authentication_refused(exc):  # retrying cannot fix a refused login: stop
            raise AuthenticationFailed(f"{what}: {describe(exc)}") from exc
        raise  # the database is unreachable, the pool is full: retried
    except _MAY_PASS:  # the database is unreachable, the pool is full: retried
        raise
    except Exception as exc:  # a creator=, a connect listener or a dialect that breaks
        raise ConfigurationError(
            f"{what}: the session factory's engine could not begin a transaction "
            f"({describe(exc)}): this is its setup, not any message's fault"
        ) from exc
    dialects.require_readable(connection, what)
    if dialects.is_mysql(connection.dialect):  # once per pooled connection
        dialects.require_mysql_server(connection, what)
    if taken is not None:  # in a transaction of its own once driver_sql sent the BEGIN
        session.info[AUTOCOMMIT_CONNECTION] = connection
        session.info[PENDING_BEGIN] = taken[1]
        return
    sqlite.begin_immediate(connection)
    dialects.require_transaction(connection, what)


def require_open(session: Session, ended: str | None = None) -> None:
    """Right before our COMMIT: the driver still says the transaction is open. A COMMIT
    with none open commits nothing and raises nothing (psycopg sends none; in autocommit
    PostgreSQL only warns), and every message would be reported done with neither its
    effects nor its record: a rollback by something the pipeline cannot see (a thread the
    handler left running, on the raw connection) since the last handler call returned.
    ``ended``: the handler guard saw it end (end_calls), though the driver may say open (a
    transaction SQLite began by itself after it)."""
    if ended is not None:
        raise TransactionBroken(
            f"{ended}, after the last handler call returned (a thread or callback of a "
            "handler still using the raw connection?): nothing of it is reported done"
        )
    state = driver_state(session.connection()) if session.in_transaction() else ENDED
    if state != OPEN:
        raise TransactionBroken(
            "the transaction was "
            + ("aborted" if state == ABORTED else "over")
            + " before the pipeline's COMMIT (a thread or callback of a handler still using "
            "the session or its raw connection?): nothing of it is reported done"
        )


def release(session: Session) -> None:
    """Before the session lets the connection go (a rollback, the attempt's end): a
    transaction SQLAlchemy counts as over but the driver not (a handler's refused
    ``connection.commit()``) is rolled back on the driver (db.pipelined_begin). The
    attempt's handler guard is lifted first."""
    end_calls(session)
    session.info.pop(PENDING_BEGIN, None)
    connection = session.info.pop(AUTOCOMMIT_CONNECTION, None)
    if connection is not None:
        pipelined_begin.roll_back_held(session, connection)


async def release_async(session: Session) -> None:
    """``release`` for an AsyncSession's sync_session."""
    end_calls(session)
    session.info.pop(PENDING_BEGIN, None)
    connection = session.info.pop(AUTOCOMMIT_CONNECTION, None)
    if connection is not None:
        await pipelined_begin.roll_back_held_async(session, connection)
