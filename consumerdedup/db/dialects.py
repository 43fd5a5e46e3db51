"""The databases and drivers consumerdedup runs on, and the check that our transactions are real.

Every guarantee rests on one database transaction holding the claim, the
handler's writes and the outbox rows together. Two settings silently break
that: a driver in autocommit mode (``isolation_level="AUTOCOMMIT"`` on the
engine, on ``engine.execution_options()``, on a connection, or the driver's
own ``autocommit=True`` in ``connect_args``), where each statement commits on
its own; and a driver whose transaction state we cannot read, so that a
handler that swallows a database error cannot be told apart from one that
succeeded. Both are refused with ConfigurationError: at construction where
the engine says so, and on the very connection a transaction uses before any
statement of ours runs, because options can change per connection.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, Engine

from ..errors import ConfigurationError
from .asyncpg_driver import adapter_autocommits, in_transaction, is_asyncpg

SUPPORTED = ("postgresql", "sqlite", "mysql", "mariadb")

_MYSQL_DRIVERS = ("pymysql", "aiomysql")  # aiomysql is PyMySQL's protocol under asyncio
SUPPORTED_DRIVERS = {
    # psycopg 3, blocking and asyncio (postgresql+psycopg://); asyncpg (postgresql+asyncpg://),
    # whose aborted state the server tells instead (db.asyncpg_driver, dedup.asyncpg_watch)
    "postgresql": ("psycopg", "asyncpg"),
    "sqlite": ("pysqlite", "aiosqlite"),  # the sqlite3 module, and aiosqlite over it
    # MySQL 8.0.1+ and MariaDB 10.6+ (mysql+pymysql://, mariadb+pymysql://, +aiomysql)
    "mysql": _MYSQL_DRIVERS,
    "mariadb": _MYSQL_DRIVERS,
}
"""The drivers whose transaction state we read after every statement (see handler_guard)."""

_AUTOCOMMIT = "AUTOCOMMIT"


def require_supported(dialect: str) -> None:
    """ConfigurationError unless ``dialect`` (SQLAlchemy's name for it) is one we run on."""
    if dialect not in SUPPORTED:
        raise ConfigurationError(
            f"unsupported database {dialect!r}: consumerdedup runs on PostgreSQL, SQLite, "
            "MySQL 8.0.1+ and MariaDB 10.6+ (" + supported_drivers() + ")"
        )


def is_mysql(dialect: Any) -> bool:
    """MySQL or MariaDB (SQLAlchemy names MariaDB ``mysql`` too, unless the URL says
    ``mariadb://``); ``dialect`` is a Dialect or its name."""
    return getattr(dialect, "name", dialect) in ("mysql", "mariadb")


MARIADB_FLOOR = (10, 6)
MYSQL_FLOOR = (8, 0, 1)
"""SKIP LOCKED (the outbox relay) and the InnoDB behaviour the guard relies on."""
_CHECKED = "consumerdedup.mysql_checked"
"""In a pooled DB-API connection's ``info``: its server and session passed the check."""


def require_mysql_server(conn: Connection, what: str) -> None:
    """MySQL/MariaDB, once per pooled connection: the server is recent enough, and the
    session's isolation and binary log settings let our statements run.

    Refused with ConfigurationError naming the fix: MariaDB older than 10.6 or MySQL
    older than 8.0.1 (no SKIP LOCKED); READ UNCOMMITTED (a lookup would take a twin's
    uncommitted claim for a record, then the twin rolls back); READ COMMITTED with the
    binary log on in STATEMENT format, where every write fails with error 1665.
    """
    info = conn.connection.info
    if info.get(_CHECKED):
        return
    version = str(conn.exec_driver_sql("SELECT VERSION()").scalar())
    mariadb = "mariadb" in version.lower()
    numbers = tuple(int(n) for n in version.split("-")[0].split(".")[:3] if n.isdigit())
    floor = MARIADB_FLOOR if mariadb else MYSQL_FLOOR
    if numbers < floor:
        raise ConfigurationError(
            f"{what}: the server is {'MariaDB' if mariadb else 'MySQL'} {version}; "
            f"consumerdedup needs MariaDB 10.6+ or MySQL 8.0.1+ (SKIP LOCKED, InnoDB's "
            "locking as documented in docs/databases.md): upgrade the server"
        )
    # MariaDB before 11.1 names it tx_isolation; MySQL 8 and later MariaDB transaction_.
    variable = "tx_isolation" if mariadb and numbers < (11, 1) else "transaction_isolation"
    row = conn.exec_driver_sql(
        f"SELECT @@SESSION.{variable}, @@SESSION.binlog_format, @@GLOBAL.log_bin"
    ).one()
    isolation = str(row[0]).upper().replace("-", " ")
    binlog_format, log_bin = str(row[1]).upper(), bool(int(row[2] or 0))
    if isolation == "READ UNCOMMITTED":
        raise ConfigurationError(
            f"{what}: the session's isolation is READ UNCOMMITTED, where a lookup reads a "
            "twin's claim before it commits (and the twin may roll back): use REPEATABLE "
            "READ (the default) or READ COMMITTED (create_engine(isolation_level=...))"
        )
    if isolation == "READ COMMITTED" and log_bin and binlog_format == "STATEMENT":
        raise ConfigurationError(
            f"{what}: the session is READ COMMITTED and the binary log is in STATEMENT "
            "format, where InnoDB refuses every write (error 1665): set binlog_format=ROW "
            "(or MIXED) on the server, or use REPEATABLE READ"
        )
    info[_CHECKED] = True


def supported_drivers() -> str:
    """The supported URL schemes, for error messages and the README."""
    return ", ".join(
        f"{dialect}+{driver}"
        for dialect, drivers in SUPPORTED_DRIVERS.items()
        for driver in drivers
    )


def require_driver(dialect: Any, what: str) -> None:
    """ConfigurationError unless ``dialect``'s database and driver are ones we can verify."""
    require_supported(dialect.name)
    if dialect.driver not in SUPPORTED_DRIVERS[dialect.name]:
        raise ConfigurationError(
            f"{what}: driver {dialect.name}+{dialect.driver} is not supported, because "
            "consumerdedup cannot read its transaction state (a handler that swallows a "
            "database error could be reported PROCESSED); use one of: " + supported_drivers()
        )


def require_fixed_schema(options: Any, what: str) -> None:
    """ConfigurationError if an engine's or connection's execution ``options`` hold a
    ``schema_translate_map``: our SQL is built once, with the names given to Tables.define,
    so the map would put the dedup records and outbox events in another schema than the
    application's writes that should commit with them."""
    if options.get("schema_translate_map"):
        raise ConfigurationError(
            f"{what}: the engine or connection has a schema_translate_map; consumerdedup "
            "builds its own SQL once, with the table names given to Tables.define, so the map "
            "does not apply to it; name the schema there (Tables.define("
            "'tenant.processed_events', 'tenant.outbox')) and give consumerdedup an engine "
            "without schema_translate_map"
        )


def require_transactional(engine: Engine, what: str, *, driver: bool = True) -> None:
    """At construction: the engine is not AUTOCOMMIT (nor, with ``driver``, on a driver
    whose transaction state we cannot read), and has no schema_translate_map."""
    if driver:
        require_driver(engine.dialect, what)
    options = engine.get_execution_options()
    require_fixed_schema(options, what)
    level = options.get("isolation_level")
    if level is None:
        # create_engine(isolation_level=...) is applied to each new DB-API connection.
        level = getattr(engine.dialect, "_on_connect_isolation_level", None)
    # On SQLite our BEGIN IMMEDIATE makes the transaction real even in autocommit mode
    # (db.sqlite); require_transaction verifies that on each connection.
    if level == _AUTOCOMMIT and engine.dialect.name != "sqlite":
        raise ConfigurationError(autocommit_message(what))


def require_transaction(conn: Connection, what: str, *, driver: bool = True) -> None:
    """On the connection a transaction really uses, before the first statement that needs it.

    Refuses a driver in autocommit mode that is not inside a transaction it
    began itself (SQLite's ``BEGIN IMMEDIATE``, see db.sqlite, makes one real
    even on an autocommit sqlite3 connection); with ``driver``, an unsupported
    driver too.
    """
    if driver:
        require_driver(conn.dialect, what)
    options = conn.get_execution_options()
    require_fixed_schema(options, what)
    level = options.get("isolation_level")
    driver_connection = conn.connection.driver_connection
    autocommits = level == _AUTOCOMMIT or _driver_autocommits(driver_connection)
    autocommits = autocommits or adapter_autocommits(conn.connection.dbapi_connection)
    if autocommits and not in_driver_transaction(driver_connection):
        raise ConfigurationError(autocommit_message(what))


def require_readable(conn: Connection, what: str) -> None:
    """ConfigurationError unless the DB-API connection itself reports its transaction state.

    The dialect's name says which module SQLAlchemy would load; ``module=`` or a
    ``creator=`` returning a wrapper (a tracing proxy) can hand it another kind of
    connection, on which every check of the transaction would be meaningless. Nor may it
    carry a schema_translate_map (require_fixed_schema).
    """
    require_fixed_schema(conn.get_execution_options(), what)
    driver_connection = conn.connection.driver_connection
    status = getattr(getattr(driver_connection, "info", None), "transaction_status", None)
    readable = status is not None if conn.dialect.name == "postgresql" else None
    if is_asyncpg(driver_connection):  # is_in_transaction(); aborted: asked of the server
        readable = True
    if is_mysql(conn.dialect):  # PyMySQL and aiomysql: the server's status flags
        readable = isinstance(getattr(driver_connection, "server_status", None), int)
    if readable is None:
        readable = isinstance(getattr(driver_connection, "in_transaction", None), bool)
    if not readable:
        raise ConfigurationError(
            f"{what}: the {conn.dialect.name}+{conn.dialect.driver} connection "
            f"({type(driver_connection).__name__}) does not report the open transaction, so "
            "whether a handler's work can commit cannot be verified; give the engine the "
            "DB-API module its dialect loads itself (no module=, and no creator= returning a "
            "wrapper around the connection)"
        )


def in_driver_transaction(driver_connection: Any) -> bool:
    """The driver's own word that a transaction is open (no round trip)."""
    if is_asyncpg(driver_connection):
        return in_transaction(driver_connection)
    info = getattr(driver_connection, "info", None)
    status = getattr(info, "transaction_status", None)
    if status is not None:  # psycopg: IDLE 0, ACTIVE 1, INTRANS 2, INERROR 3, UNKNOWN 4
        return int(status) in (1, 2, 3)
    mysql_status = mysql_server_status(driver_connection)
    if mysql_status is not None:
        return bool(mysql_status & SERVER_STATUS_IN_TRANS)
    return bool(getattr(driver_connection, "in_transaction", False))


SERVER_STATUS_IN_TRANS = 1
SERVER_STATUS_AUTOCOMMIT = 2
"""Bits of the status flags a MySQL server sends with every OK and EOF packet."""


def mysql_server_status(driver_connection: Any) -> int | None:
    """PyMySQL's and aiomysql's copy of the server's last status flags (no round trip);
    None for another driver. An error packet carries none: after a deadlock the flags
    still say "in transaction" (the guard reads the error's number instead)."""
    if type(driver_connection).__module__.split(".")[0] not in ("pymysql", "aiomysql"):
        return None
    status = getattr(driver_connection, "server_status", None)
    return status if isinstance(status, int) else 0


def _driver_autocommits(driver_connection: Any) -> bool:
    mysql_status = mysql_server_status(driver_connection)
    if mysql_status is not None:  # the session's autocommit, as the server last said
        return bool(mysql_status & SERVER_STATUS_AUTOCOMMIT) or bool(
            getattr(driver_connection, "autocommit_mode", False)
        )
    autocommit = getattr(driver_connection, "autocommit", None)
    if isinstance(autocommit, bool):  # psycopg; sqlite3 on Python 3.12+ (-1 means legacy)
        return autocommit
    # sqlite3 / aiosqlite (legacy control): None sends no BEGIN of its own.
    return getattr(driver_connection, "isolation_level", "") is None


def autocommit_message(what: str) -> str:
    return (
        f"{what}: the engine or connection is in AUTOCOMMIT mode, so every statement would "
        "commit on its own (the dedup record, the handler's writes and the outbox rows could "
        "no longer commit or roll back together, and locks would not hold); remove "
        'isolation_level="AUTOCOMMIT" (create_engine, execution_options) or the driver\'s '
        "autocommit=True in connect_args, or pass a separate engine: engine.execution_options("
        'isolation_level="READ COMMITTED")'
    )
