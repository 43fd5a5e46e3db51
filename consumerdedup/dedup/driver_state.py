"""The transaction state as the DB-API driver itself reports it, without a round trip.

psycopg keeps the server's last word (libpq's ``PQtransactionStatus``, from each
ReadyForQuery: ``pgconn.transaction_status``); sqlite3 and aiosqlite say
``in_transaction``. The guard reads it before, during and after a handler, so a check
costs nothing on the wire.
"""

from __future__ import annotations

from sqlalchemy import Connection

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
    # sqlite3 and aiosqlite: False once SQLite rolled back on its own (ON CONFLICT ROLLBACK)
    return OPEN if getattr(driver_connection, "in_transaction", None) is True else ENDED
