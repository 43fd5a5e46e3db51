"""``install``: create the library's tables and what they need (indexes, the NOTIFY
trigger, the DEFAULT partition, the version rows), reading the catalog first so that an
up-to-date database is only read; ``installed_version`` and ``ddl`` beside it."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Column, Connection, Engine, Table, insert, select, text, update
from sqlalchemy.schema import CreateColumn, CreateIndex, CreateTable

from ..db import catalog, dialects, sqlite
from ..db.names import table_sql
from ..db.partitions import AHEAD, DayPartitions
from ..errors import ConfigurationError
from ..options import instance
from .columns import utcnow
from .mysql_outbox import install_outbox_extras
from .notify import AFTER_INSERT_FOR_EACH_STATEMENT, NOTIFY_BODY
from .tables import DEFAULT, SCHEMA_VERSION, Tables

_BIND = "a sqlalchemy Engine or Connection (with asyncio: await conn.run_sync(install))"


def install(bind: Engine | Connection, tables: Tables = DEFAULT) -> None:
    """Create what is missing and fix what differs; on a database that already has
    everything, only read the catalog and the version table: change nothing, lock none
    of the other tables (the version table's read takes its ACCESS SHARE lock).

    It checks, in the catalog, the schemas, the four tables, their indexes, the
    outbox's NOTIFY trigger and its function (PostgreSQL: pg_proc's source, pg_trigger's
    kind), the DEFAULT and the days-ahead partitions (partitioned), and the recorded
    schema version. A change that needs a lock on an existing table (a dropped index,
    trigger or partition made again) waits for it at most ``catalog.LOCK_TIMEOUT``,
    then raises ``SchemaLocked`` naming the table and the fix. A day partition not made
    in time is only logged (the pruner makes it on its next round).

    Given a Connection (``await conn.run_sync(install)`` with asyncio), it runs
    inside that connection's transaction.
    """
    instance(bind, "install(bind)", (Engine, Connection), _BIND)
    instance(tables, "install(tables)", Tables, "a Tables (Tables.define(...))")
    if isinstance(bind, Engine):
        if dialects.is_mysql(bind.dialect):
            with bind.connect() as conn:
                install(conn, tables)
            return
        with bind.begin() as conn:
            install(conn, tables)
        return
    dialects.require_fixed_schema(bind.get_execution_options(), "install")
    if dialects.is_mysql(bind.dialect):
        _install_mysql(bind, tables)
        return
    _one_install_at_a_time(bind)
    _install(bind, tables)


def _install(bind: Connection, tables: Tables) -> None:
    postgres = bind.dialect.name == "postgresql"
    if tables.partitioned and not postgres:
        raise ConfigurationError(
            f"a partitioned processed_events needs PostgreSQL, not {bind.dialect.name}"
        )
    for schema in sorted({t.schema for t in tables.owned if t.schema}):
        if postgres and not catalog.schema_exists(bind, schema):
            bind.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
        elif dialects.is_mysql(bind.dialect) and not catalog.mysql_database_exists(bind, schema):
            # A MySQL schema is a database: made as PostgreSQL's schema is, in utf8mb4.
            bind.execute(text(_create_database_sql(schema)))
    present = catalog.existing(bind, tables.owned)
    pe = tables.processed_events
    if tables.partitioned and pe.fullname in present and not DayPartitions(pe).is_partitioned(bind):
        raise ConfigurationError(
            f"{pe.fullname} exists and is not partitioned: "
            "move its rows to a partitioned table, or define Tables without partitioned=True"
        )
    for table in tables.owned:
        if table.fullname not in present:
            table.create(bind)  # with its indexes; a new table is nobody's to wait on
            continue
        if lacking := catalog.missing_keys(bind, table):
            # Fails closed: dedup (or the outbox's event_id) rests on the key, and adding one
            # to a table in use is a migration's decision (it locks and may find twins).
            raise ConfigurationError(
                f"{table.fullname} lacks its {', '.join(lacking)}: restore it in a migration "
                "(docs/migrations.md); without it an effect can be applied twice"
            )
        for column in catalog.missing_columns(bind, table):
            _add_column(bind, table, column)
        for index in catalog.missing_indexes(bind, table):
            with catalog.bounded(bind, table, f"create its index {index.name}"):
                # Invalid, or ours by name on other columns: made again as defined.
                bind.execute(text(_drop_index_sql(bind, table, str(index.name))))
                index.create(bind)
    if postgres:
        # A newer release recorded its version (a rolling deploy): its trigger stays as it
        # made it, or the two releases would replace each other's at every start.
        newer = tables.version_table.fullname in present and any(
            v > SCHEMA_VERSION for v in _versions(bind, tables).values()
        )
        _install_trigger(bind, tables, keep=newer)
    if tables.partitioned:
        partitions = DayPartitions(tables.processed_events)
        default = partitions.qualified(partitions.default_name)
        if bind.execute(text("SELECT to_regclass(:d)"), {"d": default}).scalar() is None:
            with catalog.bounded(bind, tables.processed_events, "create its DEFAULT partition"):
                partitions.create_default(bind)
        partitions.make_ahead(bind, datetime.now(UTC))
    _record_version(bind, tables)


def _install_mysql(conn: Connection, tables: Tables) -> None:
    """MySQL/MariaDB: every DDL statement commits the transaction it runs in (an implicit
    COMMIT before and after), so install() never runs inside a caller's transaction: it
    would commit the caller's work half-way. It refuses a connection with one open, runs
    the checks and changes, and commits its version rows itself. Installs serialize on a
    named lock (GET_LOCK, held by this session only, released before returning)."""
    if conn.in_transaction():
        raise ConfigurationError(
            "install() on MySQL/MariaDB was given a connection inside a transaction: DDL "
            "commits implicitly there, so the caller's work would commit half-way; give it "
            "the engine, or a connection before its first statement (not conn.begin())"
        )
    dialects.require_mysql_server(conn, "install")
    got = conn.execute(
        text("SELECT GET_LOCK(:k, :t)"), {"k": INSTALL_LOCK, "t": MYSQL_INSTALL_WAIT}
    ).scalar()
    if got != 1:
        conn.rollback()
        raise catalog.SchemaLocked(
            f"another install() holds the lock {INSTALL_LOCK!r} for more than "
            f"{MYSQL_INSTALL_WAIT}s: run install() or `consumerdedup init-db` again when it "
            "ended (see SHOW PROCESSLIST)"
        )
    try:
        _install(conn, tables)
        # The producers' key-lock buckets and the relay's scan index (schema.mysql_outbox).
        install_outbox_extras(conn, tables.outbox)
        conn.commit()
    except BaseException:
        conn.rollback()
        raise
    finally:
        conn.execute(text("SELECT RELEASE_LOCK(:k)"), {"k": INSTALL_LOCK})
        conn.commit()


def _create_database_sql(schema: str) -> str:
    """MySQL/MariaDB: the database a schema-qualified table lives in (a validated identifier)."""
    return f"CREATE DATABASE IF NOT EXISTS `{schema}` CHARACTER SET utf8mb4"


MYSQL_INSTALL_WAIT = 30
"""Seconds an install() on MySQL waits for another one's named lock."""


def _add_column(conn: Connection, table: Table, column: Column[Any]) -> None:
    """A column a newer layout added: only a nullable one or one with a server default
    can be added to a table that has rows; for another, the fix is a migration."""
    if not catalog.addable(column):
        raise ConfigurationError(
            f"{table.fullname} lacks column {column.name}, which install() cannot add "
            "(NOT NULL, no default): apply the release's migration (docs/migrations.md)"
        )
    spec = CreateColumn(column).compile(dialect=conn.dialect)
    with catalog.bounded(conn, table, f"add its column {column.name}"):
        conn.execute(text(f"ALTER TABLE {table_sql(table, conn.dialect.name)} ADD COLUMN {spec}"))


def _drop_index_sql(conn: Connection, table: Table, name: str) -> str:
    if dialects.is_mysql(conn.dialect):  # an index belongs to its table there
        quoted = conn.dialect.identifier_preparer.quote(name)
        return f"DROP INDEX IF EXISTS {quoted} ON {table_sql(table, 'mysql')}"
    return f"DROP INDEX IF EXISTS {_sibling(table, name)}"


def _sibling(table: Table, name: str) -> str:
    """An index's name as SQL spells it: in its table's schema."""
    return f'"{table.schema}"."{name}"' if table.schema else f'"{name}"'


def _install_trigger(conn: Connection, tables: Tables, *, keep: bool = False) -> None:
    """The NOTIFY function and trigger, each (re)made only if missing or different;
    with ``keep``, only if missing."""
    trigger_name, function_name = tables.notify_names
    function = catalog.function(conn, tables.outbox.schema, function_name)
    found = catalog.trigger(conn, tables.outbox, trigger_name)
    if keep and function is not None and found is not None:
        return
    if function is None or function[1] != NOTIFY_BODY:
        # Replacing a function locks no table: a trigger that calls it runs the new body.
        with catalog.bounded(conn, tables.outbox, f"replace its function {function_name}()"):
            conn.execute(text(tables.notify_function_sql()))
        function = catalog.function(conn, tables.outbox.schema, function_name)
    assert function is not None
    expected = catalog.Trigger(function[0], AFTER_INSERT_FOR_EACH_STATEMENT, "O", 0, False)
    if found in (expected, replace(expected, enabled="A")):
        return
    with catalog.bounded(conn, tables.outbox, f"create its NOTIFY trigger {trigger_name}"):
        if found is not None:
            conn.execute(text(tables.drop_trigger_sql()))
        conn.execute(text(tables.create_trigger_sql()))


def _record_version(conn: Connection, tables: Tables) -> None:
    """Each data table's row in the version table says ``SCHEMA_VERSION``; a row of a
    newer release (a rolling deploy: the newer instance installed first) stays."""
    versions = _versions(conn, tables)
    vt = tables.version_table
    stamp = utcnow()
    for table in tables.all:
        recorded = versions.get(table.fullname)
        if recorded is None:
            conn.execute(
                insert(vt).values(
                    table_name=table.fullname, version=SCHEMA_VERSION, installed_at=stamp
                )
            )
        elif recorded < SCHEMA_VERSION:
            conn.execute(
                update(vt)
                .where(vt.c.table_name == table.fullname)
                .values(version=SCHEMA_VERSION, installed_at=stamp)
            )


def _versions(conn: Connection, tables: Tables) -> dict[str, int]:
    vt = tables.version_table
    names = [t.fullname for t in tables.all]
    query = select(vt.c.table_name, vt.c.version).where(vt.c.table_name.in_(names))
    return {name: int(version) for name, version in conn.execute(query)}


INSTALL_LOCK = "consumerdedup.install"
"""PostgreSQL: the advisory lock (one-int form, hashtext of this) every install() holds
to the end of its transaction."""


def _one_install_at_a_time(conn: Connection) -> None:
    """Installs serialize before reading the catalog: two processes starting at once would
    both read "missing" and both CREATE, and the second fail (a duplicate pg_namespace or
    pg_type row, "table already exists"). PostgreSQL: an advisory lock only installs take
    (producers and relays never wait on it); SQLite: the write lock (BEGIN IMMEDIATE)."""
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(hashtext(:k))"), {"k": INSTALL_LOCK})
    else:
        sqlite.begin_immediate(conn)


def installed_version(bind: Engine | Connection, tables: Tables = DEFAULT) -> int | None:
    """The schema version ``install()`` recorded for these tables: the lowest of the three
    tables' versions; None when the version table or a table's row is missing (tables made
    by a release before versions, or by hand). ``SCHEMA_VERSION`` is this release's."""
    if isinstance(bind, Engine):
        with bind.connect() as conn:
            return installed_version(conn, tables)
    if tables.version_table.fullname not in catalog.existing(bind, [tables.version_table]):
        return None
    versions = _versions(bind, tables)
    if any(t.fullname not in versions for t in tables.all):
        return None
    return min(versions.values())


def version_rows_sql(tables: Tables, dialect: str = "postgresql") -> list[str]:
    """The INSERTs that record ``SCHEMA_VERSION`` for a fresh set of tables (as install()
    does), for ``ddl()`` and a migration's upgrade()."""
    into = table_sql(tables.version_table, dialect)
    return [
        f"INSERT INTO {into} (table_name, version, installed_at) "
        f"VALUES ('{table.fullname}', {SCHEMA_VERSION}, CURRENT_TIMESTAMP)"
        for table in tables.all  # validated identifiers: nothing to escape
    ]


def ddl(engine: Engine, tables: Tables = DEFAULT) -> str:
    """The CREATE statements ``install`` would run, for review or a migration tool."""
    if tables.partitioned and engine.dialect.name != "postgresql":
        raise ConfigurationError(
            f"a partitioned processed_events needs PostgreSQL, not {engine.dialect.name}"
        )
    statements: list[str] = []
    for schema in sorted({t.schema for t in tables.owned if t.schema}):
        if engine.dialect.name == "postgresql":
            statements.append(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
        elif dialects.is_mysql(engine.dialect):
            statements.append(_create_database_sql(schema))
    for table in tables.owned:
        statements.append(str(CreateTable(table).compile(dialect=engine.dialect)).strip())
        for index in sorted(table.indexes, key=lambda i: str(i.name)):
            statements.append(str(CreateIndex(index).compile(dialect=engine.dialect)).strip())
    statements.extend(version_rows_sql(tables, engine.dialect.name))
    if engine.dialect.name == "postgresql":
        statements.extend(tables.notify_trigger_ddl())
    if tables.partitioned:
        partitions = DayPartitions(tables.processed_events)
        statements.append(
            f"CREATE TABLE IF NOT EXISTS {partitions.qualified(partitions.default_name)} "
            f"PARTITION OF {partitions.parent} DEFAULT"
        )
        statements.append(
            "-- day partitions: install() and every pruner round make them "
            f"{AHEAD} days ahead;\n-- drop them only with the pruner, which checks every window"
        )
    return ";\n\n".join(statements) + ";\n"
