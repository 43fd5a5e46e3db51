"""The columns of the library's four tables, each with why it is there.

``Tables.define`` (schema.tables) resolves and checks the names; the functions here
build one ``Table`` each on the MetaData it is given, with its indexes.
"""

from __future__ import annotations

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

from ..db.names import fit_name

ID_LENGTH = 255

# SQLite makes only an INTEGER PRIMARY KEY an alias of its rowid (auto-increment).
_BIGINT_ID = BigInteger().with_variant(Integer(), "sqlite")


def utcnow() -> datetime:
    """The time stamped in our tables' columns (timezone-aware, UTC)."""
    return datetime.now(UTC)


def _index_name(table: str, what: str) -> str:
    return fit_name("ix_", table, what)


def processed_events_table(
    metadata: MetaData, schema: str | None, name: str, *, partitioned: bool
) -> Table:
    """One row per decided message; ``partitioned``: range-partitioned by day."""
    # A partitioned table's keys must include the partition key, processed_at.
    partition_options: dict[str, Any] = {}
    if partitioned:
        partition_options["postgresql_partition_by"] = "RANGE (processed_at)"
    return Table(
        name,
        metadata,
        Column("consumer", String(ID_LENGTH), primary_key=True),
        Column("message_id", String(ID_LENGTH), primary_key=True),
        Column("processed_at", DateTime(timezone=True), nullable=False, primary_key=partitioned),
        Column("payload_hash", String(64), nullable=False),
        Column("outcome", String(16), nullable=False),
        # Why a FAILED message failed, so a redelivery is dead-lettered with the same reason.
        Column("error", Text, nullable=True),
        Index(_index_name(name, "processed_at"), "processed_at"),
        schema=schema,
        **partition_options,
    )


def outbox_table(metadata: MetaData, schema: str | None, name: str) -> Table:
    """One row per event to publish, from the transaction that wrote it until pruned."""
    return Table(
        name,
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
            _index_name(name, "unpublished"),
            "id",
            postgresql_where=text("published_at IS NULL"),
            sqlite_where=text("published_at IS NULL"),
        ),
        Index(
            _index_name(name, "failing"),
            "key",
            "id",
            postgresql_where=text("published_at IS NULL AND attempts > 0"),
            sqlite_where=text("published_at IS NULL AND attempts > 0"),
        ),
        Index(_index_name(name, "published_at"), "published_at"),
        schema=schema,
    )


def idempotency_keys_table(metadata: MetaData, schema: str | None, name: str) -> Table:
    """One row per HTTP idempotency key in a scope: its claim, then its stored response."""
    return Table(
        name,
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
        Index(_index_name(name, "expires_at"), "expires_at"),
        schema=schema,
    )


def version_table(metadata: MetaData, schema: str | None, name: str) -> Table:
    """One row per table of a set: the schema version ``install()`` recorded for it."""
    return Table(
        name,
        metadata,
        # A table's name as Tables spells it (schema-qualified when given), so the
        # several table sets one database may hold each have their rows.
        Column("table_name", String(2 * ID_LENGTH), primary_key=True),
        Column("version", Integer, nullable=False),
        Column("installed_at", DateTime(timezone=True), nullable=False),
        schema=schema,
    )
