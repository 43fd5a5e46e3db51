"""The library's tables, as SQLAlchemy Core objects users can merge into Alembic.

``tables = Tables.define(metadata=my_metadata)`` adds them to your own
MetaData (so ``alembic revision --autogenerate`` sees them); ``install(engine)``
creates them directly, idempotently.
"""

from __future__ import annotations

from dataclasses import dataclass
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
    text,
)
from sqlalchemy.schema import CreateIndex, CreateTable

from .db.names import fit_name, split_name
from .db.partitions import AHEAD, DayPartitions
from .errors import ConfigurationError

ID_LENGTH = 255
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
    """The processed_events, outbox and idempotency_keys tables, under names you choose."""

    metadata: MetaData
    processed_events: Table
    outbox: Table
    idempotency_keys: Table
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
    ) -> Tables:
        """The tables; ``partitioned=True`` makes processed_events range-partitioned by day.

        ``idempotency_keys`` (the HTTP idempotency-key records) defaults to a
        table of that name in processed_events' schema.

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
        if len({processed_events, outbox, idempotency_keys}) < 3:
            raise ConfigurationError(
                f"the tables need three different names, not {processed_events!r}, "
                f"{outbox!r} and {idempotency_keys!r}"
            )
        for name in (processed_events, outbox, idempotency_keys):
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
        return cls(
            metadata=metadata,
            processed_events=pe,
            outbox=ob,
            idempotency_keys=ik,
            partitioned=partitioned,
        )

    @property
    def all(self) -> tuple[Table, Table, Table]:
        return (self.processed_events, self.outbox, self.idempotency_keys)

    @property
    def notify_channel(self) -> str:
        """The NOTIFY channel of triggers installed by earlier releases, named by how the
        table was spelled (``public.outbox`` and ``outbox`` differed). Relays listen on it
        too until ``install()`` replaces the trigger; now it is ``notify_channel_of(oid)``."""
        return f"{NOTIFY_PREFIX}{self.outbox.fullname.replace('.', '_')}"[:63]

    def notify_trigger_ddl(self) -> list[str]:
        """PostgreSQL: a statement-level trigger that NOTIFYs relays on insert.

        NOTIFY is delivered at commit, so a relay wakes exactly when new rows
        become visible; a rolled-back insert wakes nobody.
        """
        table = self.outbox
        qualified = f'"{table.schema}"."{table.name}"' if table.schema else f'"{table.name}"'
        function = f"{table.name}_notify"[:63]
        function = f'"{table.schema}"."{function}"' if table.schema else f'"{function}"'
        trigger = f'"{table.name}_notify"'
        return [
            f"CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS "
            # By the table's OID, as the relay's locks: every spelling of one table (with
            # or without its schema) is one channel, and two outboxes are two.
            f"$$ BEGIN PERFORM pg_notify('{NOTIFY_PREFIX}' || TG_RELID::text, ''); "
            "RETURN NULL; END $$",
            f"DROP TRIGGER IF EXISTS {trigger} ON {qualified}",
            f"CREATE TRIGGER {trigger} AFTER INSERT ON {qualified} "
            f"FOR EACH STATEMENT EXECUTE FUNCTION {function}()",
        ]


def notify_channel_of(oid: int) -> str:
    """The NOTIFY channel the outbox trigger wakes relays on: the table's OID, resolved."""
    return f"{NOTIFY_PREFIX}{oid}"


DEFAULT = Tables.define()
metadata = DEFAULT.metadata
processed_events = DEFAULT.processed_events
outbox = DEFAULT.outbox


def install(bind: Engine | Connection, tables: Tables = DEFAULT) -> None:
    """Create the schemas and tables that are missing; safe to run any number of times.

    Given a Connection (``await conn.run_sync(install)`` with asyncio), it runs
    inside that connection's transaction.
    """
    if isinstance(bind, Engine):
        with bind.begin() as conn:
            install(conn, tables)
        return
    postgres = bind.dialect.name == "postgresql"
    if tables.partitioned and not postgres:
        raise ConfigurationError(
            f"a partitioned processed_events needs PostgreSQL, not {bind.dialect.name}"
        )
    if postgres:
        for schema in sorted({t.schema for t in tables.all if t.schema}):
            bind.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
    tables.metadata.create_all(bind, tables=list(tables.all), checkfirst=True)
    if postgres:
        for statement in tables.notify_trigger_ddl():
            bind.execute(text(statement))
    if tables.partitioned:
        partitions = DayPartitions(tables.processed_events)
        if not partitions.is_partitioned(bind):
            raise ConfigurationError(
                f"{tables.processed_events.fullname} exists and is not partitioned: "
                "move its rows to a partitioned table, or define Tables without partitioned=True"
            )
        partitions.create_default(bind)
        partitions.make_ahead(bind, datetime.now(UTC))


def ddl(engine: Engine, tables: Tables = DEFAULT) -> str:
    """The CREATE statements ``install`` would run, for review or a migration tool."""
    if tables.partitioned and engine.dialect.name != "postgresql":
        raise ConfigurationError(
            f"a partitioned processed_events needs PostgreSQL, not {engine.dialect.name}"
        )
    statements: list[str] = []
    for schema in sorted({t.schema for t in tables.all if t.schema}):
        if engine.dialect.name == "postgresql":
            statements.append(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
    for table in tables.all:
        statements.append(str(CreateTable(table).compile(dialect=engine.dialect)).strip())
        for index in sorted(table.indexes, key=lambda i: str(i.name)):
            statements.append(str(CreateIndex(index).compile(dialect=engine.dialect)).strip())
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
