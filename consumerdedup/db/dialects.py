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

SUPPORTED = ("postgresql", "sqlite")

SUPPORTED_DRIVERS = {
    "postgresql": ("psycopg",),  # psycopg 3, blocking and asyncio (postgresql+psycopg://)
    "sqlite": ("pysqlite", "aiosqlite"),  # the sqlite3 module, and aiosqlite over it
}
"""The drivers whose transaction state we read after every statement (see handler_guard)."""

_AUTOCOMMIT = "AUTOCOMMIT"


def require_supported(dialect: str) -> None:
    """ConfigurationError unless ``dialect`` (SQLAlchemy's name for it) is one we run on."""
    if dialect not in SUPPORTED:
        raise ConfigurationError(
            f"unsupported database {dialect!r}: consumerdedup runs on " + " and ".join(SUPPORTED)
        )


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
    info = getattr(driver_connection, "info", None)
    status = getattr(info, "transaction_status", None)
    if status is not None:  # psycopg: IDLE 0, ACTIVE 1, INTRANS 2, INERROR 3, UNKNOWN 4
        return int(status) in (1, 2, 3)
    return bool(getattr(driver_connection, "in_transaction", False))


def _driver_autocommits(driver_connection: Any) -> bool:
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
