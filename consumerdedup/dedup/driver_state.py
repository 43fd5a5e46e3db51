"""The transaction state as the DB-API driver itself reports it, without a round trip.

psycopg keeps the server's last word (``connection.info.transaction_status``, from
each ReadyForQuery); sqlite3 and aiosqlite say ``in_transaction``. The guard reads
it before, during and after a handler, so a check costs nothing on the wire.
"""

from __future__ import annotations

from sqlalchemy import Connection

OPEN = "open"
ABORTED = "aborted"
ENDED = "ended"


def idle(connection: Connection) -> bool:
    """The driver says no transaction is open, on a healthy connection."""
    driver_connection = connection.connection.driver_connection
    status = getattr(getattr(driver_connection, "info", None), "transaction_status", None)
    if status is not None:
        return int(status) == 0  # psycopg's IDLE (UNKNOWN, 4, is a lost connection)
    return getattr(driver_connection, "in_transaction", None) is False


def driver_state(connection: Connection) -> str:
    """``open``, ``aborted`` or ``ended``, from the driver without a round trip.

    Only drivers that tell are accepted (db.dialects.require_driver); should
    another reach here anyway, its silence reads as ``ended``, never as healthy.
    """
    driver_connection = connection.connection.driver_connection
    info = getattr(driver_connection, "info", None)
    status = getattr(info, "transaction_status", None)
    if status is not None:  # psycopg: IDLE 0, ACTIVE 1, INTRANS 2, INERROR 3, UNKNOWN 4
        return {2: OPEN, 1: OPEN, 3: ABORTED}.get(int(status), ENDED)
    # sqlite3 and aiosqlite: False once SQLite rolled back on its own (ON CONFLICT ROLLBACK)
    return OPEN if getattr(driver_connection, "in_transaction", None) is True else ENDED
