"""Our statements on MySQL and MariaDB: the claim, a plain INSERT whose duplicate-key error
means DUPLICATE, and the claim check before COMMIT; as PyMySQL and aiomysql take them.

MySQL has no ``ON CONFLICT DO NOTHING`` and no ``RETURNING`` (MariaDB's INSERT RETURNING
cannot skip a conflict). ``INSERT IGNORE`` is never used: it turns NOT NULL, truncation
and foreign-key errors into warnings. ``ON DUPLICATE KEY UPDATE`` with a no-op change
cannot tell a claim from a duplicate either: SQLAlchemy's MySQL dialects connect with
CLIENT.FOUND_ROWS, so a found row counts 1 just like an inserted one.

So: one multi-row INSERT of the rows in key order (the common case, nothing claimed yet:
one statement); if any key exists, error 1062 undoes that statement alone (InnoDB's
statement-level rollback; the transaction and its earlier work stand) and the rows go
one INSERT each, a 1062 meaning that key is not ours. A key a twin holds uncommitted makes
our INSERT wait on its lock, as on PostgreSQL: the twin commits (1062: DUPLICATE) or
rolls back (ours). Several waiters of a key whose holder rolls back can deadlock on the
gap locks (1213): InnoDB then rolls back one of them, whole, which is retried (transient).

Why driver SQL (as dedup/driver_sql does on psycopg): SQLAlchemy compiled the multi-row
INSERT anew for every claim (its VALUES differ in length) and ran its per-statement work
(a cache key, an execution context, a result) for each of our statements: about a third
of the pipeline's client CPU a message. Here each statement is a plain string joined for
the batch's size (the VALUES and IN lists; no compilation, no cache) and goes to the
driver's own cursor on the connection the session's transaction holds. What the
statements decide is written once, as ``plan`` generators; ``run`` and ``run_async`` only
send what they yield.
"""

from __future__ import annotations

import importlib
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection
from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from ..db import mysql_errors
from ..db.direct import translated

ROWS_PER_STATEMENT = 1000
"""Rows of one multi-row INSERT (6 values each): far under max_allowed_packet's default."""
_COLUMNS = ("consumer", "message_id", "processed_at", "payload_hash", "outcome", "error")


@dataclass(frozen=True, slots=True)
class Sent:
    """One statement for the driver (``%s`` parameters, PyMySQL's format). ``duplicate``:
    a duplicate key (1062) answers None instead of raising."""

    sql: str
    args: Sequence[Any]
    duplicate: bool = False


Plan = Generator[Sent, list[tuple[Any, ...]] | None, Any]


def _stamp(value: datetime) -> datetime:
    """As UtcDateTime binds it: UTC, without a zone (DATETIME(6))."""
    return value if value.tzinfo is None else value.astimezone(UTC).replace(tzinfo=None)


@dataclass(frozen=True, slots=True)
class KeyedInsert:
    """INSERT the rows of processed_events; the keys that were ours come back as rows."""

    table: str
    """processed_events as MySQL spells it (db.names.table_sql)."""

    def plan(self, rows: Sequence[Mapping[str, Any]]) -> Plan:
        ours: list[tuple[str]] = []
        for start in range(0, len(rows), ROWS_PER_STATEMENT):
            chunk = rows[start : start + ROWS_PER_STATEMENT]
            if (yield self._insert(chunk)) is not None:
                ours += [(row["message_id"],) for row in chunk]
                continue
            if len(chunk) == 1:  # that one key is not ours: no second try of it alone
                continue
            for row in chunk:  # the statement alone was undone: row by row now
                if (yield self._insert([row])) is not None:
                    ours.append((row["message_id"],))
        return ours

    def _insert(self, rows: Sequence[Mapping[str, Any]]) -> Sent:
        values = ", ".join(["(%s, %s, %s, %s, %s, %s)"] * len(rows))
        args: list[Any] = []
        for row in rows:
            args += (row[column] for column in _COLUMNS)
            args[-4] = _stamp(args[-4])
        sql = f"INSERT INTO {self.table} ({', '.join(_COLUMNS)}) VALUES {values}"
        return Sent(sql, args, duplicate=True)


@dataclass(frozen=True, slots=True)
class ClaimCount:
    """COUNT the claims of ``keys`` stamped ``claimed_at`` (statements.holds): one row."""

    table: str
    processed: str
    """Outcome.PROCESSED's value."""

    def plan(self, params: Mapping[str, Any]) -> Plan:
        keys = params["keys"]
        marks = ", ".join(["%s"] * len(keys))
        sql = (
            f"SELECT count(*) FROM {self.table} WHERE consumer = %s AND message_id IN "
            f"({marks}) AND processed_at = %s AND outcome = '{self.processed}' "
            "AND error IS NULL"
        )
        return (yield Sent(sql, [params["consumer"], *keys, _stamp(params["claimed_at"])]))


MySQLStatement = KeyedInsert | ClaimCount


def _direct(raw: Any) -> Any:
    """The driver's plain cursor class (tuples, whatever ``cursorclass`` the application
    set) if ``raw`` is PyMySQL's or aiomysql's own connection (not a proxy from
    ``creator=``), else None: SQLAlchemy's path. (Imported here: both are extras.)"""
    module = type(raw).__module__.split(".")[0]
    if module == "pymysql":
        return importlib.import_module("pymysql.cursors").Cursor
    if module == "aiomysql":
        return importlib.import_module("aiomysql").Cursor
    return None


def _refused(connection: Connection, sent: Sent, exc: Exception, cursor: Any) -> Exception | None:
    """None if ``exc`` is the duplicate key ``sent`` takes as an answer, else what to raise
    (a driver error as SQLAlchemy raises it: db.direct.translated)."""
    if sent.duplicate and mysql_errors.errno(exc) == mysql_errors.DUPLICATE_KEY:
        return None
    if isinstance(exc, sa_exc.DBAPIError):
        return exc
    return translated(connection, sent.sql, sent.args, exc, cursor)


def run(session: Session, statement: MySQLStatement, params: Any) -> Any:
    """Carry out ``statement.plan(params)`` in the session's transaction; what it returns."""
    connection = session.connection()
    raw = connection.connection.driver_connection
    cursor_class = _direct(raw)
    plan = statement.plan(params)
    reply: list[tuple[Any, ...]] | None = None
    while True:
        try:
            sent = plan.send(reply)
        except StopIteration as stop:
            return stop.value
        cursor = None
        try:
            if cursor_class is None:
                reply = list(connection.exec_driver_sql(sent.sql, tuple(sent.args)))
                continue
            cursor = cursor_class(raw)
            cursor.execute(sent.sql, sent.args)
            reply = list(cursor.fetchall())
        except (connection.dialect.loaded_dbapi.Error, sa_exc.DBAPIError) as exc:
            error = _refused(connection, sent, exc, cursor)
            if error is not None:
                raise error from exc
            reply = None
        finally:
            if cursor is not None:
                cursor.close()


async def run_async(session: AsyncSession, statement: MySQLStatement, params: Any) -> Any:
    """``run`` for an AsyncSession: awaited on the aiomysql connection itself."""
    # The transaction's connection exists already (begin_checked ran): no I/O, no await.
    connection = session.sync_session.connection()
    raw = connection.connection.driver_connection
    cursor_class = _direct(raw)
    plan = statement.plan(params)
    reply: list[tuple[Any, ...]] | None = None
    while True:
        try:
            sent = plan.send(reply)
        except StopIteration as stop:
            return stop.value
        cursor = None
        try:
            if cursor_class is None:
                own = await session.connection()
                reply = list(await own.exec_driver_sql(sent.sql, tuple(sent.args)))
                continue
            cursor = cursor_class(raw)
            await cursor.execute(sent.sql, sent.args)
            reply = list(await cursor.fetchall())
        except (connection.dialect.loaded_dbapi.Error, sa_exc.DBAPIError) as exc:
            error = _refused(connection, sent, exc, cursor)
            if error is not None:
                raise error from exc
            reply = None
        finally:
            if cursor is not None:
                await cursor.close()
