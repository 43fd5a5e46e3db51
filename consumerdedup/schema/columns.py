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
from sqlalchemy.dialects import mysql

from ..db.mysql_types import MYSQL, KeyString, UtcDateTime
from ..db.names import fit_name

ID_LENGTH = 255
"""Characters of a key column (a message id, a consumer name, an HTTP key). On MySQL in
utf8mb4 (4 bytes a character) the (consumer, message_id) primary key is 2,040 bytes,
within InnoDB's 3,072-byte index limit (DYNAMIC/COMPRESSED rows, the default since 5.7)."""

# SQLite makes only an INTEGER PRIMARY KEY an alias of its rowid (auto-increment).
_BIGINT_ID = BigInteger().with_variant(Integer(), "sqlite")
# Keys compare byte for byte everywhere: on MySQL a binary, NO PAD collation (the server's
# default one is case-insensitive and ignores trailing spaces: "A1" would be a DUPLICATE of
# "a1 "), see db.mysql_types.
_KEY = String(ID_LENGTH).with_variant(KeyString(ID_LENGTH), *MYSQL)
# MySQL's DATETIME keeps no zone and, unless told, no fraction of a second: microseconds
# and UTC in, aware UTC out, as PostgreSQL's timestamptz gives.
_STAMP = DateTime(timezone=True).with_variant(UtcDateTime(), *MYSQL)
# MySQL's BLOB and TEXT stop at 64 KiB (an outbox event's body, a long error).
_BYTES = LargeBinary().with_variant(mysql.LONGBLOB(), *MYSQL)
_TEXT = Text().with_variant(mysql.MEDIUMTEXT(), *MYSQL)
# InnoDB (transactions, row locks) and utf8mb4 whatever the server's defaults are.
_MYSQL_TABLE: dict[str, Any] = {"mysql_engine": "InnoDB", "mysql_charset": "utf8mb4"}


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
        Column("consumer", _KEY, primary_key=True),
        Column("message_id", _KEY, primary_key=True),
        Column("processed_at", _STAMP, nullable=False, primary_key=partitioned),
        Column("payload_hash", String(64), nullable=False),
        Column("outcome", String(16), nullable=False),
        # Why a FAILED message failed, so a redelivery is dead-lettered with the same reason.
        Column("error", _TEXT, nullable=True),
        Index(_index_name(name, "processed_at"), "processed_at"),
        schema=schema,
        **_MYSQL_TABLE,
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
        Column("body", _BYTES, nullable=False),
        Column("headers", JSON, nullable=False),
        Column("created_at", _STAMP, nullable=False),
        Column("attempts", Integer, nullable=False, server_default=text("0")),
        Column("available_at", _STAMP, nullable=False),
        Column("published_at", _STAMP, nullable=True),
        Column("last_error", _TEXT, nullable=True),
        # Parked: failed max_attempts publishes, no relay tries it until replayed.
        Column("parked_at", _STAMP, nullable=True),
        Column("parked_reason", _TEXT, nullable=True),
        # Abandoned by an operator: never published, holds no key back, pruned later.
        Column("abandoned_at", _STAMP, nullable=True),
        Column("abandoned_by", String(ID_LENGTH), nullable=True),
        Column("abandoned_reason", _TEXT, nullable=True),
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
        **_MYSQL_TABLE,
    )


def idempotency_keys_table(metadata: MetaData, schema: str | None, name: str) -> Table:
    """One row per HTTP idempotency key in a scope: its claim, then its stored response."""
    return Table(
        name,
        metadata,
        # scope: principal digest + method + route (consumerdedup.http.flow.scope_of).
        Column("scope", _KEY, primary_key=True),
        Column("key", _KEY, primary_key=True),
        Column("fingerprint", String(64), nullable=False),
        Column("state", String(16), nullable=False),  # in_flight, completed, not_stored
        # Who holds an in-flight claim, and until when (its lease): a dead worker's lapses.
        Column("token", String(32), nullable=True),
        Column("locked_until", _STAMP, nullable=True),
        Column("status", Integer, nullable=True),
        Column("headers", JSON, nullable=True),
        Column("body", _BYTES, nullable=True),
        Column("created_at", _STAMP, nullable=False),
        Column("expires_at", _STAMP, nullable=True),
        Index(_index_name(name, "expires_at"), "expires_at"),
        schema=schema,
        **_MYSQL_TABLE,
    )


def version_table(metadata: MetaData, schema: str | None, name: str) -> Table:
    """One row per table of a set: the schema version ``install()`` recorded for it."""
    return Table(
        name,
        metadata,
        # A table's name as Tables spells it (schema-qualified when given), so the
        # several table sets one database may hold each have their rows.
        Column(
            "table_name",
            String(2 * ID_LENGTH).with_variant(KeyString(2 * ID_LENGTH), *MYSQL),
            primary_key=True,
        ),
        Column("version", Integer, nullable=False),
        Column("installed_at", _STAMP, nullable=False),
        schema=schema,
        **_MYSQL_TABLE,
    )
