"""The library's tables, as SQLAlchemy Core objects users can merge into Alembic.

``tables = Tables.define(metadata=my_metadata)`` adds them to your own
MetaData (so ``alembic revision --autogenerate`` sees them; the recipe is
docs/migrations.md, its helpers ``consumerdedup.migrations``);
``install(engine)`` creates them directly, idempotently: on a database that
already has everything it only reads the catalog and the version table, changes
nothing and locks none of the other tables. ``installed_version(engine)`` reads
the schema version it recorded.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    Connection,
    DateTime,
    Engine,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    insert,
    select,
    text,
    update,
)
from sqlalchemy.schema import CreateColumn, CreateIndex, CreateTable

from .db import catalog, sqlite
from .db.catalog import SchemaLocked
from .db.names import fit_name, split_name, table_sql
from .db.partitions import AHEAD, DayPartitions
from .errors import ConfigurationError

__all__ = ["SCHEMA_VERSION", "SchemaLocked", "Tables", "ddl", "install", "installed_version"]

ID_LENGTH = 255
SCHEMA_VERSION = 1
"""The layout of the tables this release reads and writes; ``install()`` records it per
table in the version table, and a release that changes the layout raises it (see
docs/migrations.md). Version 1: the tables as of the first release that records one."""
VERSION_TABLE = "consumerdedup_schema"
NOTIFY_PREFIX = "consumerdedup_"
"""Of the PostgreSQL NOTIFY channels that wake outbox relays."""


def utcnow() -> datetime:
    """The time stamped in our tables' columns (timezone-aware, UTC)."""
    return datetime.now(UTC)


def _index_name(table: str, what: str) -> str:
    return fit_name("ix_", table, what)


# SQLite makes only an INTEGER PRIMARY KEY an alias of its rowid (auto-increment).
_BIGINT_ID = BigInteger().with_variant(Integer(), "sqlite")


@dataclass(frozen=True)
class Tables:
    """The processed_events, outbox and idempotency_keys tables, under names you choose,
    and the version table where ``install()`` records their schema version."""

    metadata: MetaData
    processed_events: Table
    outbox: Table
    idempotency_keys: Table
    version_table: Table
    partitioned: bool = False
    """processed_events is range-partitioned by day on processed_at (PostgreSQL only)."""

    def __repr__(self) -> str:
        """The ``define()`` call that names these tables (``Tables.define()`` for the
        defaults), not every Column: it is what help() shows for ``tables=DEFAULT``."""
        pe, ob = self.processed_events, self.outbox
        schema = f"{pe.schema}." if pe.schema else ""
        args = []
        if (pe.fullname, ob.fullname) != ("processed_events", "outbox"):
            args = [repr(pe.fullname), repr(ob.fullname)]
        if self.idempotency_keys.fullname != f"{schema}idempotency_keys":
            args.append(f"idempotency_keys={self.idempotency_keys.fullname!r}")
        if self.version_table.fullname != f"{schema}{VERSION_TABLE}":
            args.append(f"version_table={self.version_table.fullname!r}")
        if self.partitioned:
            args.append("partitioned=True")
        return f"Tables.define({', '.join(args)})"

    @classmethod
    def define(
        cls,
        processed_events: str = "processed_events",
        outbox: str = "outbox",
        metadata: MetaData | None = None,
        *,
        partitioned: bool = False,
        idempotency_keys: str | None = None,
        version_table: str | None = None,
    ) -> Tables:
        """The tables; ``partitioned=True`` makes processed_events range-partitioned by day.

        ``idempotency_keys`` (the HTTP idempotency-key records) defaults to a
        table of that name in processed_events' schema, and ``version_table`` (one row per
        table: its schema version) to ``consumerdedup_schema`` there.

        A partitioned table lets the pruner drop whole days instead of deleting
        rows (20x faster), but PostgreSQL cannot keep (consumer, message_id)
        unique across partitions, so each claim takes a per-key advisory lock
        and looks the key up in every partition first (see README: Partitioned
        processed_events). Every Deduplicator on the table must be told.
        """
        metadata = metadata if metadata is not None else MetaData()
        pe_schema, pe_name = split_name(processed_events)
        ob_schema, ob_name = split_name(outbox)
        if idempotency_keys is None:
            idempotency_keys = f"{pe_schema}.idempotency_keys" if pe_schema else "idempotency_keys"
        ik_schema, ik_name = split_name(idempotency_keys)
        if version_table is None:
            version_table = f"{pe_schema}.{VERSION_TABLE}" if pe_schema else VERSION_TABLE
        vt_schema, vt_name = split_name(version_table)
        if len({processed_events, outbox, idempotency_keys, version_table}) < 4:
            raise ConfigurationError(
                f"the tables need four different names, not {processed_events!r}, "
                f"{outbox!r}, {idempotency_keys!r} and {version_table!r}"
            )
        for name in (processed_events, outbox, idempotency_keys, version_table):
            if name in metadata.tables:
                raise ConfigurationError(f"table {name!r} is already defined on this MetaData")
        if not isinstance(partitioned, bool):
            raise ConfigurationError(f"partitioned must be a bool, not {partitioned!r}")
        # A partitioned table's keys must include the partition key, processed_at.
        partition_options: dict[str, Any] = {}
        if partitioned:
            partition_options["postgresql_partition_by"] = "RANGE (processed_at)"
        pe = Table(
            pe_name,
            metadata,
            Column("consumer", String(ID_LENGTH), primary_key=True),
            Column("message_id", String(ID_LENGTH), primary_key=True),
            Column(
                "processed_at", DateTime(timezone=True), nullable=False, primary_key=partitioned
            ),
            Column("payload_hash", String(64), nullable=False),
            Column("outcome", String(16), nullable=False),
            # Why a FAILED message failed, so a redelivery is dead-lettered with the same reason.
            Column("error", Text, nullable=True),
            Index(_index_name(pe_name, "processed_at"), "processed_at"),
            schema=pe_schema,
            **partition_options,
        )
        ob = Table(
            ob_name,
            metadata,
            Column("id", _BIGINT_ID, Identity(), primary_key=True),
            Column("event_id", String(64), nullable=False, unique=True),
            Column("destination", String(ID_LENGTH), nullable=False),
            Column("key", String(ID_LENGTH), nullable=True),
            Column("body", LargeBinary, nullable=False),
            Column("headers", JSON, nullable=False),
            Column("created_at", DateTime(timezone=True), nullable=False),
            Column("attempts", Integer, nullable=False, server_default=text("0")),
            Column("available_at", DateTime(timezone=True), nullable=False),
            Column("published_at", DateTime(timezone=True), nullable=True),
            Column("last_error", Text, nullable=True),
            # Parked: failed max_attempts publishes, no relay tries it until replayed.
            Column("parked_at", DateTime(timezone=True), nullable=True),
            Column("parked_reason", Text, nullable=True),
            # Abandoned by an operator: never published, holds no key back, pruned later.
            Column("abandoned_at", DateTime(timezone=True), nullable=True),
            Column("abandoned_by", String(ID_LENGTH), nullable=True),
            Column("abandoned_reason", Text, nullable=True),
            # The relay's scans: unpublished rows in id order, and the few failing ones by key.
            Index(
                _index_name(ob_name, "unpublished"),
                "id",
                postgresql_where=text("published_at IS NULL"),
                sqlite_where=text("published_at IS NULL"),
            ),
            Index(
                _index_name(ob_name, "failing"),
                "key",
                "id",
                postgresql_where=text("published_at IS NULL AND attempts > 0"),
                sqlite_where=text("published_at IS NULL AND attempts > 0"),
            ),
            Index(_index_name(ob_name, "published_at"), "published_at"),
            schema=ob_schema,
        )
        ik = Table(
            ik_name,
            metadata,
            # scope: principal digest + method + route (consumerdedup.http.flow.scope_of).
            Column("scope", String(ID_LENGTH), primary_key=True),
            Column("key", String(ID_LENGTH), primary_key=True),
            Column("fingerprint", String(64), nullable=False),
            Column("state", String(16), nullable=False),  # in_flight, completed, not_stored
            # Who holds an in-flight claim, and until when (its lease): a dead worker's lapses.
            Column("token", String(32), nullable=True),
            Column("locked_until", DateTime(timezone=True), nullable=True),
            Column("status", Integer, nullable=True),
            Column("headers", JSON, nullable=True),
            Column("body", LargeBinary, nullable=True),
            Column("created_at", DateTime(timezone=True), nullable=False),
            Column("expires_at", DateTime(timezone=True), nullable=True),
            Index(_index_name(ik_name, "expires_at"), "expires_at"),
            schema=ik_schema,
        )
        vt = Table(
            vt_name,
            metadata,
            # A table's name as Tables spells it (schema-qualified when given), so the
            # several table sets one database may hold each have their rows.
            Column("table_name", String(2 * ID_LENGTH), primary_key=True),
            Column("version", Integer, nullable=False),
            Column("installed_at", DateTime(timezone=True), nullable=False),
            schema=vt_schema,
        )
        return cls(
            metadata=metadata,
            processed_events=pe,
            outbox=ob,
            idempotency_keys=ik,
            version_table=vt,
            partitioned=partitioned,
        )

    @property
    def all(self) -> tuple[Table, Table, Table]:
        """The three tables that hold data (the version table is ``owned``'s fourth)."""
        return (self.processed_events, self.outbox, self.idempotency_keys)

    @property
    def owned(self) -> tuple[Table, Table, Table, Table]:
        """Every table ``install()`` creates: ``all`` and the version table."""
        return (*self.all, self.version_table)

    @property
    def notify_channel(self) -> str:
        """The NOTIFY channel of triggers installed by earlier releases, named by how the
        table was spelled (``public.outbox`` and ``outbox`` differed). Relays listen on it
        too until ``install()`` replaces the trigger; now it is ``notify_channel_of(oid)``."""
        return f"{NOTIFY_PREFIX}{self.outbox.fullname.replace('.', '_')}"[:63]

    @property
    def notify_names(self) -> tuple[str, str]:
        """The outbox's NOTIFY trigger and its function, unquoted (the function in the
        outbox's schema; in the current schema when the outbox has none)."""
        name = f"{self.outbox.name}_notify"[:63]
        return name, name

    def notify_trigger_ddl(self) -> list[str]:
        """PostgreSQL: a statement-level trigger that NOTIFYs relays on insert.

        NOTIFY is delivered at commit, so a relay wakes exactly when new rows
        become visible; a rolled-back insert wakes nobody. These statements replace
        whatever is there (for a migration or ``--sql``); ``install()`` sends only
        the ones that something missing or different needs.
        """
        return [self.notify_function_sql(), self.drop_trigger_sql(), self.create_trigger_sql()]

    def notify_function_sql(self) -> str:
        return (
            f"CREATE OR REPLACE FUNCTION {self._function_sql()}() RETURNS trigger "
            f"LANGUAGE plpgsql AS $${NOTIFY_BODY}$$"
        )

    def drop_trigger_sql(self) -> str:
        return f'DROP TRIGGER IF EXISTS "{self.notify_names[0]}" ON {self._outbox_sql()}'

    def create_trigger_sql(self) -> str:
        return (
            f'CREATE TRIGGER "{self.notify_names[0]}" AFTER INSERT ON {self._outbox_sql()} '
            f"FOR EACH STATEMENT EXECUTE FUNCTION {self._function_sql()}()"
        )

    def drop_function_sql(self) -> str:
        return f"DROP FUNCTION IF EXISTS {self._function_sql()}()"

    def _outbox_sql(self) -> str:
        table = self.outbox
        return f'"{table.schema}"."{table.name}"' if table.schema else f'"{table.name}"'

    def _function_sql(self) -> str:
        function = self.notify_names[1]
        return f'"{self.outbox.schema}"."{function}"' if self.outbox.schema else f'"{function}"'


# By the table's OID, as the relay's locks: every spelling of one table (with or without
# its schema) is one channel, and two outboxes are two. install() compares it with pg_proc.
NOTIFY_BODY = (
    f" BEGIN PERFORM pg_notify('{NOTIFY_PREFIX}' || TG_RELID::text, ''); RETURN NULL; END "
)
_AFTER_INSERT_FOR_EACH_STATEMENT = 4
"""pg_trigger.tgtype of our trigger: TRIGGER_TYPE_INSERT, neither ROW nor BEFORE."""


def notify_channel_of(oid: int) -> str:
    """The NOTIFY channel the outbox trigger wakes relays on: the table's OID, resolved."""
    return f"{NOTIFY_PREFIX}{oid}"


DEFAULT = Tables.define()
metadata = DEFAULT.metadata
processed_events = DEFAULT.processed_events
outbox = DEFAULT.outbox


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
    if isinstance(bind, Engine):
        with bind.begin() as conn:
            install(conn, tables)
        return
    _one_install_at_a_time(bind)
    postgres = bind.dialect.name == "postgresql"
    if tables.partitioned and not postgres:
        raise ConfigurationError(
            f"a partitioned processed_events needs PostgreSQL, not {bind.dialect.name}"
        )
    if postgres:
        for schema in sorted({t.schema for t in tables.owned if t.schema}):
            if not catalog.schema_exists(bind, schema):
                bind.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
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
                bind.execute(text(f"DROP INDEX IF EXISTS {_sibling(table, str(index.name))}"))
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


def _add_column(conn: Connection, table: Table, column: Column[Any]) -> None:
    """A column a newer layout added: only a nullable one or one with a server default
    can be added to a table that has rows; for another, the fix is a migration."""
    if not column.nullable and column.server_default is None:
        raise ConfigurationError(
            f"{table.fullname} lacks column {column.name}, which install() cannot add "
            "(NOT NULL, no default): apply the release's migration (docs/migrations.md)"
        )
    spec = CreateColumn(column).compile(dialect=conn.dialect)
    with catalog.bounded(conn, table, f"add its column {column.name}"):
        conn.execute(text(f"ALTER TABLE {table_sql(table, conn.dialect.name)} ADD COLUMN {spec}"))


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
    expected = catalog.Trigger(function[0], _AFTER_INSERT_FOR_EACH_STATEMENT, "O", 0, False)
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
