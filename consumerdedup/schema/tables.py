"""``Tables``: the library's four tables under the names you choose, and the schema
version's constants; creating them is ``install`` (schema.install).

The columns are in schema.columns, the outbox's NOTIFY trigger in schema.notify; this
module resolves and checks the names and ties the tables together.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import MetaData, Table

from ..db.names import split_name
from ..errors import ConfigurationError
from ..options import boolean, instance, maybe
from . import columns, notify
from .offset_table import consumer_offsets_table

SCHEMA_VERSION = 1
"""The layout of the tables this release reads and writes; ``install()`` records it per
table in the version table, and a release that changes the layout raises it (see
docs/migrations.md). Version 1: the tables as of the first release that records one."""
VERSION_TABLE = "consumerdedup_schema"
OFFSETS_TABLE = "consumer_offsets"


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
    consumer_offsets: Table | None = None
    """Kafka partitions' next offsets, for ``KafkaConfig(offsets="database")``
    (schema.offset_table); ``define()`` always sets it."""

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
        offsets = self.consumer_offsets
        if offsets is not None and offsets.fullname != f"{schema}{OFFSETS_TABLE}":
            args.append(f"consumer_offsets={offsets.fullname!r}")
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
        consumer_offsets: str | None = None,
    ) -> Tables:
        """The tables; ``partitioned=True`` makes processed_events range-partitioned by day.

        ``idempotency_keys`` (the HTTP idempotency-key records) defaults to a
        table of that name in processed_events' schema, and ``version_table`` (one row per
        table: its schema version) to ``consumerdedup_schema`` there, and
        ``consumer_offsets`` (Kafka offsets kept in the database) to ``consumer_offsets``.

        A partitioned table lets the pruner drop whole days instead of deleting
        rows (20x faster), but PostgreSQL cannot keep (consumer, message_id)
        unique across partitions, so each claim takes a per-key advisory lock
        and looks the key up in every partition first (see README: Partitioned
        processed_events). Every Deduplicator on the table must be told.
        """
        option = "Tables.define"
        given = maybe(metadata, f"{option}(metadata)", instance, MetaData, "a MetaData or None")
        metadata = given if given is not None else MetaData()
        partitioned = boolean(partitioned, f"{option}(partitioned)")
        pe_schema = split_name(processed_events, f"{option}(processed_events)")[0]
        if idempotency_keys is None:
            idempotency_keys = f"{pe_schema}.idempotency_keys" if pe_schema else "idempotency_keys"
        if version_table is None:
            version_table = f"{pe_schema}.{VERSION_TABLE}" if pe_schema else VERSION_TABLE
        if consumer_offsets is None:
            consumer_offsets = f"{pe_schema}.{OFFSETS_TABLE}" if pe_schema else OFFSETS_TABLE
        names = (processed_events, outbox, idempotency_keys, version_table, consumer_offsets)
        options = (
            "processed_events",
            "outbox",
            "idempotency_keys",
            "version_table",
            "consumer_offsets",
        )
        pe, ob, ik, vt, co = (
            split_name(n, f"{option}({o})") for n, o in zip(names, options, strict=True)
        )
        if len(set(names)) < len(names):
            raise ConfigurationError(
                f"the tables need five different names, not {processed_events!r}, "
                f"{outbox!r}, {idempotency_keys!r}, {version_table!r} and {consumer_offsets!r}"
            )
        for name in names:
            if name in metadata.tables:
                raise ConfigurationError(f"table {name!r} is already defined on this MetaData")
        return cls(
            metadata=metadata,
            processed_events=columns.processed_events_table(metadata, *pe, partitioned=partitioned),
            outbox=columns.outbox_table(metadata, *ob),
            idempotency_keys=columns.idempotency_keys_table(metadata, *ik),
            version_table=columns.version_table(metadata, *vt),
            partitioned=partitioned,
            consumer_offsets=consumer_offsets_table(metadata, *co),
        )

    @property
    def all(self) -> tuple[Table, ...]:
        """The tables that hold data (the version table is ``owned``'s last)."""
        data = (self.processed_events, self.outbox, self.idempotency_keys)
        return data if self.consumer_offsets is None else (*data, self.consumer_offsets)

    @property
    def owned(self) -> tuple[Table, ...]:
        """Every table ``install()`` creates: ``all`` and the version table."""
        return (*self.all, self.version_table)

    @property
    def offsets(self) -> Table:
        """consumer_offsets (``define()`` sets it; a Tables made by hand may lack it)."""
        if self.consumer_offsets is None:
            raise ConfigurationError(
                "these Tables have no consumer_offsets table: make them with Tables.define()"
            )
        return self.consumer_offsets

    @property
    def notify_channel(self) -> str:
        """The NOTIFY channel of triggers installed by earlier releases: relays listen on
        it too until ``install()`` replaces the trigger; now it is ``notify_channel_of(oid)``."""
        return notify.legacy_channel(self.outbox)

    @property
    def notify_names(self) -> tuple[str, str]:
        """The outbox's NOTIFY trigger and its function, unquoted."""
        return notify.trigger_names(self.outbox)

    def notify_trigger_ddl(self) -> list[str]:
        """PostgreSQL: the statement-level trigger that NOTIFYs relays on insert, replacing
        whatever is there (schema.notify says why a statement-level trigger)."""
        return notify.trigger_ddl(self.outbox)

    def notify_function_sql(self) -> str:
        return notify.function_sql(self.outbox)

    def drop_trigger_sql(self) -> str:
        return notify.drop_trigger_sql(self.outbox)

    def create_trigger_sql(self) -> str:
        return notify.create_trigger_sql(self.outbox)

    def drop_function_sql(self) -> str:
        return notify.drop_function_sql(self.outbox)


DEFAULT = Tables.define()
metadata = DEFAULT.metadata
processed_events = DEFAULT.processed_events
outbox = DEFAULT.outbox
