"""admin_audit: the admin pages' audit trail, one row per action (consumerdedup.admin's
``AuditTable``; ``admin_app(audit="table")``): who, as which role, what, on which search,
how many, why, when, the first ids and the error if it failed.

Not one of ``Tables``' data tables: only a service that serves the admin pages with this
trail needs it, and ``install_audit`` (``consumerdedup init-db --admin-audit``) creates it
beside them, in processed_events' schema by default.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    DateTime,
    Engine,
    Identity,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    text,
)

from ..db.names import split_name
from .columns import ID_LENGTH

AUDIT_TABLE = "admin_audit"


def audit_table_name(processed_events: Table) -> str:
    """``admin_audit`` in processed_events' schema."""
    schema = processed_events.schema
    return f"{schema}.{AUDIT_TABLE}" if schema else AUDIT_TABLE


def admin_audit_table(name: str, metadata: MetaData | None = None) -> Table:
    """The table under ``name`` (schema-qualified allowed, validated as identifiers)."""
    schema, table = split_name(name, "admin audit table")
    return Table(
        table,
        metadata if metadata is not None else MetaData(),
        Column("id", BigInteger().with_variant(Integer(), "sqlite"), Identity(), primary_key=True),
        Column("at", DateTime(timezone=True), nullable=False),
        Column("who", String(ID_LENGTH), nullable=False),
        Column("role", String(32), nullable=False),
        Column("action", String(64), nullable=False),
        Column("target", Text, nullable=False),  # JSON: the scope and the search
        Column("count", Integer, nullable=False),
        Column("reason", Text, nullable=False),
        Column("ids", Text, nullable=False),  # JSON: the first ids acted on
        Column("error", Text, nullable=True),
        Index(f"ix_{table}_at", "at"),
        schema=schema,
        mysql_engine="InnoDB",
        mysql_charset="utf8mb4",
    )


def install_audit(bind: Engine | Connection, table: Table) -> None:
    """Create the table and its index if missing (idempotent); PostgreSQL: its schema too."""
    if isinstance(bind, Engine):
        with bind.begin() as conn:
            install_audit(conn, table)
        return
    if bind.dialect.name == "postgresql" and table.schema:
        bind.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{table.schema}"'))
    table.create(bind, checkfirst=True)
