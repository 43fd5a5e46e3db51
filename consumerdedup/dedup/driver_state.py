"""The transaction state as the DB-API driver itself reports it, without a round trip.

psycopg keeps the server's last word (libpq's ``PQtransactionStatus``, from each
ReadyForQuery: ``pgconn.transaction_status``); sqlite3 and aiosqlite say
``in_transaction``; PyMySQL and aiomysql keep the status flags of the server's last OK
packet (``server_status``: in transaction or not; MySQL has no aborted state, and an
error packet carries no flags, so a deadlock's rollback is read from the error's number
by the guard, handler_guard). The guard reads it before, during and after a handler, so a check
costs nothing on the wire.
"""

from __future__ import annotations

from sqlalchemy import Connection

from ..db.asyncpg_driver import in_transaction, is_asyncpg
from ..db.dialects import SERVER_STATUS_IN_TRANS, mysql_server_status

OPEN = "open"
ABORTED = "aborted"
ENDED = "ended"


_PSYCOPG_STATES = {2: OPEN, 1: OPEN, 3: ABORTED}
"""psycopg's INTRANS, ACTIVE and INERROR; IDLE (0) and UNKNOWN (4, a lost connection) are
``ended``."""


def idle(connection: Connection) -> bool:
    """The driver says no transaction is open, on a healthy connection."""
    return idle_of(connection.connection.driver_connection)


def idle_of(driver_connection: object) -> bool:
    """``idle`` of a DB-API driver's own connection."""
    pgconn = getattr(driver_connection, "pgconn", None)
    if pgconn is not None:
        return int(pgconn.transaction_status) == 0  # IDLE (UNKNOWN, 4, is a lost connection)
    if is_asyncpg(driver_connection):  # a closed connection is a lost one, not idle
        return not (driver_connection.is_closed() or in_transaction(driver_connection))  # type: ignore[attr-defined]
    status = mysql_server_status(driver_connection)
    if status is not None:
        return not status & SERVER_STATUS_IN_TRANS
    return getattr(driver_connection, "in_transaction", None) is False


def driver_state(connection: Connection) -> str:
    """``open``, ``aborted`` or ``ended``, from the driver without a round trip."""
    return state_of(connection.connection.driver_connection)


def state_of(driver_connection: object) -> str:
    """``driver_state`` of a DB-API driver's own connection.

    Only drivers that tell are accepted (db.dialects.require_driver); should
    another reach here anyway, its silence reads as ``ended``, never as healthy.
    """
    pgconn = getattr(driver_connection, "pgconn", None)
    if pgconn is not None:  # psycopg: libpq's last word, an int, read without a round trip
        return _PSYCOPG_STATES.get(int(pgconn.transaction_status), ENDED)
    status = mysql_server_status(driver_connection)
    if status is not None:  # PyMySQL, aiomysql: no aborted state (see the module's doc)
        return OPEN if status & SERVER_STATUS_IN_TRANS else ENDED
    if is_asyncpg(driver_connection):  # open, or aborted: the server tells (asyncpg_watch)
        closed = driver_connection.is_closed()  # type: ignore[attr-defined]
        return OPEN if in_transaction(driver_connection) and not closed else ENDED
    # sqlite3 and aiosqlite: False once SQLite rolled back on its own (ON CONFLICT ROLLBACK)
    return OPEN if getattr(driver_connection, "in_transaction", None) is True else ENDED
