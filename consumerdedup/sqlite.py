"""Make pysqlite transactions real, so savepoints and read-then-write work on SQLite.

By default the sqlite3 module issues BEGIN only before DML and treats
SAVEPOINT outside a transaction as the outermost one, so releasing a batch's
first savepoint would commit it. SQLAlchemy documents the fix: let SQLAlchemy
emit BEGIN itself. Our own sessions ask for BEGIN IMMEDIATE, because every
dedup transaction writes, and taking the write lock up front lets concurrent
writers wait on busy_timeout instead of failing on a lock upgrade.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, event

BEGIN_OPTION = "consumerdedup_sqlite_begin"
_PREPARED = "_consumerdedup_sqlite_prepared"


def prepare(engine: Engine) -> Engine:
    """Install the transaction fix once on a SQLite engine; returns an engine for our sessions."""
    if engine.dialect.name != "sqlite":
        return engine
    if not getattr(engine, _PREPARED, False):
        event.listen(engine, "connect", _autocommit_driver)
        event.listen(engine, "begin", _begin)
        setattr(engine, _PREPARED, True)
    return engine.execution_options(**{BEGIN_OPTION: "BEGIN IMMEDIATE"})


def _autocommit_driver(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.isolation_level = None


def _begin(conn: Any) -> None:
    dbapi_connection = conn.connection.dbapi_connection
    # Connections pooled before prepare() ran never saw the connect hook.
    if dbapi_connection.isolation_level is not None:
        dbapi_connection.isolation_level = None
    conn.exec_driver_sql(conn.get_execution_options().get(BEGIN_OPTION, "BEGIN"))
