"""What the database already has of our tables, read from its catalog without taking locks.

``install()`` reads here first and changes only what is missing or different:
reading pg_class, pg_index, pg_proc and pg_trigger (or SQLite's sqlite_master)
takes no lock on the tables read about, so it never waits on, nor queues ahead of, a
transaction that holds one (a producer's open outbox INSERT). DDL that must
run goes through ``bounded``: it waits for its lock at most ``LOCK_TIMEOUT``
and then fails with ``SchemaLocked``, naming the table and the fix.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Column, Connection, Index, Table, inspect, text
from sqlalchemy.exc import DBAPIError

from ..errors import ConsumerDedupError
from .names import table_sql

LOCK_TIMEOUT = "1s"
"""Longest a DDL statement of ``install()`` waits for its table lock: while it waits,
every later statement on the table queues behind it."""
LOCK_NOT_AVAILABLE = "55P03"


class SchemaLocked(ConsumerDedupError, TimeoutError):
    """A change ``install()`` needs could not get its table's lock within ``LOCK_TIMEOUT``."""


@dataclass(frozen=True)
class Trigger:
    """One row of pg_trigger, what install() compares with the trigger it would create."""

    function: int
    type: int
    enabled: str
    arguments: int
    has_condition: bool


def schema_exists(conn: Connection, schema: str) -> bool:
    statement = text("SELECT 1 FROM pg_namespace WHERE nspname = :s")
    return conn.execute(statement, {"s": schema}).first() is not None


def existing(conn: Connection, tables: Sequence[Table]) -> set[str]:
    """The fullnames of the ``tables`` the database has."""
    inspector = inspect(conn)
    return {t.fullname for t in tables if inspector.has_table(t.name, schema=t.schema)}


def missing_columns(conn: Connection, table: Table) -> list[Column[Any]]:
    """The table's columns (as defined on it) that the database's table lacks: a table made
    by an older release, before a column was added."""
    found = {c["name"] for c in inspect(conn).get_columns(table.name, schema=table.schema)}
    return [c for c in table.columns if c.name not in found]


def missing_indexes(conn: Connection, table: Table) -> list[Index]:
    """The table's indexes (as defined on it) that the database lacks or holds invalid
    (a failed CREATE INDEX CONCURRENTLY leaves one); an invalid one is dropped first."""
    wanted = sorted(table.indexes, key=lambda i: str(i.name))
    if conn.dialect.name != "postgresql":
        found = {i["name"] for i in inspect(conn).get_indexes(table.name, schema=table.schema)}
        return [i for i in wanted if i.name not in found]
    statement = text(
        "SELECT c.relname, i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
        "WHERE i.indrelid = to_regclass(:t)"
    )
    valid = {str(name): bool(ok) for name, ok in conn.execute(statement, {"t": table_sql(table)})}
    return [i for i in wanted if valid.get(str(i.name)) is not True]


def function(conn: Connection, schema: str | None, name: str) -> tuple[int, str] | None:
    """(oid, source) of the plpgsql trigger function ``name()`` in ``schema`` (the
    current schema, where an unqualified CREATE FUNCTION puts it, when None)."""
    statement = text(
        "SELECT p.oid, p.prosrc FROM pg_proc p "
        "JOIN pg_namespace n ON n.oid = p.pronamespace "
        "JOIN pg_language l ON l.oid = p.prolang "
        "WHERE p.proname = :name AND p.pronargs = 0 AND l.lanname = 'plpgsql' "
        "AND p.prorettype = 'pg_catalog.trigger'::regtype "
        "AND n.nspname = COALESCE(:schema, current_schema())"
    )
    row = conn.execute(statement, {"name": name, "schema": schema}).first()
    return (int(row[0]), str(row[1])) if row is not None else None


def trigger(conn: Connection, table: Table, name: str) -> Trigger | None:
    statement = text(
        "SELECT tgfoid, tgtype, tgenabled, tgnargs, tgqual IS NOT NULL FROM pg_trigger "
        "WHERE tgrelid = to_regclass(:t) AND tgname = :name AND NOT tgisinternal"
    )
    row = conn.execute(statement, {"t": table_sql(table), "name": name}).first()
    if row is None:
        return None
    return Trigger(int(row[0]), int(row[1]), str(row[2]), int(row[3]), bool(row[4]))


@contextmanager
def bounded(conn: Connection, table: Table, change: str) -> Iterator[None]:
    """DDL on ``table`` inside: each lock waited for at most ``LOCK_TIMEOUT`` (PostgreSQL),
    the caller's own lock_timeout restored after; a lock not granted is ``SchemaLocked``."""
    if conn.dialect.name != "postgresql":
        yield
        return
    saved = conn.execute(text("SELECT current_setting('lock_timeout')")).scalar_one()
    conn.execute(text("SELECT set_config('lock_timeout', :v, true)"), {"v": LOCK_TIMEOUT})
    try:
        yield
    except DBAPIError as error:
        if getattr(error.orig, "sqlstate", None) != LOCK_NOT_AVAILABLE:
            raise
        raise SchemaLocked(
            f"{table.fullname} is held by another transaction: install() needs to {change}, "
            f"which needs a lock on the table, not granted within {LOCK_TIMEOUT}. Run "
            "install() or `consumerdedup init-db` again when no transaction holds the table "
            "for long (idle in transaction sessions: see pg_stat_activity), or apply the "
            "change in a migration (docs/migrations.md)"
        ) from error
    conn.execute(text("SELECT set_config('lock_timeout', :v, true)"), {"v": saved})
