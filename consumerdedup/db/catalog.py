"""What the database already has of our tables, read from its catalog without taking locks.

``install()`` reads here first and changes only what is missing or different:
reading pg_class, pg_index, pg_proc and pg_trigger (or SQLite's sqlite_master)
takes no lock on the tables read about, so it never waits on, nor queues ahead of, a
transaction that holds one (a producer's open outbox INSERT). DDL that must
run goes through ``bounded``: it waits for its lock at most ``LOCK_TIMEOUT``
and then fails with ``SchemaLocked``, naming the table and the fix.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    Column,
    Connection,
    Index,
    String,
    Table,
    TypeDecorator,
    UniqueConstraint,
    inspect,
    text,
)
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


def mysql_database_exists(conn: Connection, database: str) -> bool:
    statement = text("SELECT 1 FROM information_schema.SCHEMATA WHERE SCHEMA_NAME = :s")
    return conn.execute(statement, {"s": database}).first() is not None


def existing(conn: Connection, tables: Sequence[Table]) -> set[str]:
    """The fullnames of the ``tables`` the database has."""
    inspector = inspect(conn)
    return {t.fullname for t in tables if inspector.has_table(t.name, schema=t.schema)}


def missing_columns(conn: Connection, table: Table) -> list[Column[Any]]:
    """The table's columns (as defined on it) that the database's table lacks: a table made
    by an older release, before a column was added."""
    found = {c["name"] for c in inspect(conn).get_columns(table.name, schema=table.schema)}
    return [c for c in table.columns if c.name not in found]


def unwritable_columns(conn: Connection, table: Table) -> list[tuple[str, str]]:
    """(column, what is wrong) for each column the database's table has in a way the
    library's INSERTs fail on, all names present: one of its own NOT NULL without a default
    (made by hand: no INSERT of ours names it), one of ours nullable made NOT NULL (ours
    write NULL), or a string column of ours shorter than ours is."""
    ours = {c.name: c for c in table.columns}
    found: list[tuple[str, str]] = []
    for column in inspect(conn).get_columns(table.name, schema=table.schema):
        name = column["name"]
        mine = ours.get(name)
        if mine is None:
            generated = column.get("autoincrement") is True or bool(
                column.get("identity") or column.get("computed")
            )
            if not column["nullable"] and column.get("default") is None and not generated:
                found.append((name, "NOT NULL without a default, not ours: give it a default"))
            continue
        if mine.nullable and not column["nullable"]:
            found.append((name, "NOT NULL, ours is nullable: drop its NOT NULL"))
        ours_is = mine.type.dialect_impl(conn.dialect)
        if _text(ours_is) and not _text(column["type"]):
            found.append((name, f"{column['type']}, ours is text: make it {ours_is}"))
            continue
        wanted = getattr(ours_is, "length", None)
        length = getattr(column["type"], "length", None)
        if wanted is not None and length is not None and length < wanted:
            found.append((name, f"length {length}, ours is {wanted}: widen it"))
    return found


def _text(kind: Any) -> bool:
    """A string type (VARCHAR, TEXT, an ENUM), one a TypeDecorator wraps included."""
    return isinstance(kind.impl if isinstance(kind, TypeDecorator) else kind, String)


def addable(column: Column[Any]) -> bool:
    """Whether ``install()`` can add the column to a table that has rows: a nullable one,
    or one with a server default (any other needs a migration)."""
    return bool(column.nullable) or column.server_default is not None


def missing_indexes(conn: Connection, table: Table) -> list[Index]:
    """The table's indexes (as defined on it) that the database lacks, holds invalid (a
    failed CREATE INDEX CONCURRENTLY leaves one) or holds under the same name on other
    columns, uniqueness or predicate (a hand-made or migrated one): each is dropped first.
    A name alone proves nothing; the definition is compared."""
    wanted = sorted(table.indexes, key=lambda i: str(i.name))
    found = _index_shapes(conn, table)
    return [i for i in wanted if found.get(str(i.name)) != _shape(i, conn)]


_PARTIAL = ("postgresql", "sqlite")
IndexShape = tuple[tuple[str, ...], bool, str]
"""(columns in order, unique, predicate normalized): what an index must be to count."""


def _shape(index: Index, conn: Connection) -> IndexShape:
    dialect = conn.dialect.name
    where = index.dialect_options[dialect].get("where") if dialect in _PARTIAL else None
    columns = tuple(str(c.name) for c in index.columns)
    return columns, bool(index.unique), _predicate(str(where) if where is not None else "")


def _predicate(text_: str) -> str:
    return re.sub(r"[()\s]", "", text_).lower()


def _index_shapes(conn: Connection, table: Table) -> dict[str, IndexShape | None]:
    """Each index the database has on ``table``, by name; None for an invalid one."""
    if conn.dialect.name == "postgresql":
        statement = text(
            "SELECT c.relname, i.indisvalid, i.indisunique, "
            "COALESCE(pg_get_expr(i.indpred, i.indrelid), ''), "
            "ARRAY(SELECT a.attname FROM unnest(i.indkey::int2[]) WITH ORDINALITY AS k(n, o) "
            "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.n ORDER BY k.o) "
            "FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE i.indrelid = to_regclass(:t)"
        )
        return {
            str(name): (tuple(cols), bool(unique), _predicate(pred)) if ok else None
            for name, ok, unique, pred, cols in conn.execute(statement, {"t": table_sql(table)})
        }
    found: dict[str, IndexShape | None] = {}
    for index in inspect(conn).get_indexes(table.name, schema=table.schema):
        where = index.get("dialect_options", {}).get("sqlite_where")
        columns = tuple(str(c) for c in index["column_names"])
        found[str(index["name"])] = (
            columns,
            bool(index["unique"]),
            _predicate(str(where) if where is not None else ""),
        )
    return found


def _unpartitioned(columns: list[str]) -> list[str]:
    """A key without its trailing partition column: a partitioned processed_events' key
    must hold processed_at, and a Tables defined without partitioned=True still uses it."""
    return columns[:-1] if columns[-1:] == ["processed_at"] else columns


def missing_keys(conn: Connection, table: Table) -> list[str]:
    """The primary key and unique constraints the table is defined with that the database's
    table lacks (dropped by a migration, or the table made by hand): dedup and the outbox's
    event_id rest on them, so a table without one must not be used."""
    inspector = inspect(conn)
    lacking = []
    wanted_pk = [str(c.name) for c in table.primary_key.columns]
    found_pk = inspector.get_pk_constraint(table.name, schema=table.schema)
    found = [str(c) for c in found_pk.get("constrained_columns") or []]
    if wanted_pk and _unpartitioned(found) != _unpartitioned(wanted_pk):
        lacking.append(f"primary key ({', '.join(wanted_pk)})")
    uniques = {
        tuple(u["column_names"])
        for u in inspector.get_unique_constraints(table.name, schema=table.schema)
    }
    uniques |= {
        tuple(str(c) for c in i["column_names"])
        for i in inspector.get_indexes(table.name, schema=table.schema)
        if i["unique"] and not (i.get("dialect_options") or {}).get(f"{conn.dialect.name}_where")
    }
    for constraint in table.constraints:
        if isinstance(constraint, UniqueConstraint):
            columns = tuple(str(c.name) for c in constraint.columns)
            if columns not in uniques:
                lacking.append(f"unique ({', '.join(columns)})")
    return lacking


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
