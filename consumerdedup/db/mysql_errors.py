"""MySQL and MariaDB error numbers, as PyMySQL and aiomysql raise them (``orig.args[0]``).

MySQL's SQLSTATEs are too coarse to act on (40001 is a deadlock, but 23000 is every
integrity error and HY000 most of the rest), so the pipeline reads the error number.
What InnoDB undoes on an error is the point (docs/databases.md): most errors undo their
statement alone, as if it had run in a savepoint; a deadlock undoes the WHOLE transaction,
and with autocommit off the next statement silently opens a new one.
"""

from __future__ import annotations

DUPLICATE_KEY = 1062
"""ER_DUP_ENTRY: the claim's key exists (the statement alone is undone)."""
DEADLOCK = 1213
LOCK_WAIT_TIMEOUT = 1205

ENDS_TRANSACTION = frozenset(
    {
        DEADLOCK,  # ER_LOCK_DEADLOCK: InnoDB rolled the whole transaction back
        # ER_LOCK_WAIT_TIMEOUT: the statement alone, or the whole transaction under
        # innodb_rollback_on_timeout; the guard does not tell them apart (fails closed).
        LOCK_WAIT_TIMEOUT,
        1180,  # ER_ERROR_DURING_COMMIT
        1181,  # ER_ERROR_DURING_ROLLBACK
        1317,  # ER_QUERY_INTERRUPTED (KILL QUERY may roll back a statement's transaction)
        1927,  # ER_CONNECTION_KILLED (MariaDB)
        1969,  # ER_STATEMENT_TIMEOUT (MariaDB max_statement_time)
        3024,  # ER_QUERY_TIMEOUT (MySQL max_execution_time)
        4031,  # ER_CLIENT_INTERACTION_TIMEOUT (idle session ended)
        2006,  # CR_SERVER_GONE_ERROR
        2013,  # CR_SERVER_LOST
    }
)
"""Errors after which the transaction the statement ran in is, or may be, gone."""

TRANSIENT = frozenset(
    {
        DEADLOCK,
        LOCK_WAIT_TIMEOUT,
        1040,  # ER_CON_COUNT_ERROR: too many connections
        1053,  # ER_SERVER_SHUTDOWN
        1205,
        1927,
        2002,  # CR_CONNECTION_ERROR
        2003,  # CR_CONN_HOST_ERROR
        2006,
        2013,
        4031,
        1021,  # ER_DISK_FULL
        1037,  # ER_OUTOFMEMORY
        1041,  # ER_OUT_OF_RESOURCES
        1206,  # ER_LOCK_TABLE_FULL
        1614,  # ER_XA_RBDEADLOCK
        1637,  # ER_TOO_MANY_CONCURRENT_TRXS
    }
)
"""Contention or the environment, never the message's own fault."""

SETUP = frozenset(
    {
        1044,  # ER_DBACCESS_DENIED_ERROR
        1045,  # ER_ACCESS_DENIED_ERROR
        1049,  # ER_BAD_DB_ERROR
        1054,  # ER_BAD_FIELD_ERROR
        1142,  # ER_TABLEACCESS_DENIED_ERROR
        1143,  # ER_COLUMNACCESS_DENIED_ERROR
        1146,  # ER_NO_SUCH_TABLE
        1227,  # ER_SPECIFIC_ACCESS_DENIED_ERROR
        1290,  # ER_OPTION_PREVENTS_STATEMENT (--read-only)
        1792,  # ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION
        1836,  # ER_READ_ONLY_MODE
    }
)
"""The deploy's fault (a missing table or column, rights, a read-only server)."""


def errno(error: BaseException | None) -> int | None:
    """The server's (or the client library's) error number of a PyMySQL/aiomysql error,
    itself or as SQLAlchemy wraps it (``.orig``); None for anything else."""
    orig = getattr(error, "orig", None) or error
    if orig is None or type(orig).__module__.split(".")[0] not in ("pymysql", "aiomysql"):
        return None
    args = getattr(orig, "args", ())
    return args[0] if args and isinstance(args[0], int) else None
