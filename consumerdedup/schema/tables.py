"""The library's tables as SQLAlchemy Core objects (``Tables``), the NOTIFY trigger's SQL
and the schema version's constants; creating them is ``install`` (schema.install).

Past 250 lines because ``Tables.define`` holds the four table definitions, each column
with why it is there, and they read best together with the names they derive."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    DateTime,
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

from ..db.names import fit_name, split_name
from ..errors import ConfigurationError

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
AFTER_INSERT_FOR_EACH_STATEMENT = 4
"""pg_trigger.tgtype of our trigger: TRIGGER_TYPE_INSERT, neither ROW nor BEFORE."""


def notify_channel_of(oid: int) -> str:
    """The NOTIFY channel the outbox trigger wakes relays on: the table's OID, resolved."""
    return f"{NOTIFY_PREFIX}{oid}"


DEFAULT = Tables.define()
metadata = DEFAULT.metadata
processed_events = DEFAULT.processed_events
outbox = DEFAULT.outbox
