"""Alembic helpers: consumerdedup's tables in your migrations (the recipe: docs/migrations.md).

Two ways to keep them, both tested with Alembic itself (tests/migrations):

- Together: ``Tables.define(..., metadata=your_metadata)`` puts the tables on
  your MetaData, so ``alembic revision --autogenerate`` writes their
  ``create_table`` and ``create_index`` (the partitioned one included). What
  autogenerate cannot produce, you call from the migration:
  ``create_schemas`` first in upgrade(), ``upgrade_extras`` last (the outbox's
  NOTIFY trigger, the DEFAULT and days-ahead partitions, the schema version),
  and ``downgrade_extras`` first in downgrade(). ``include_object(tables,
  ours=True)`` keeps the day partitions, which the pruner makes and drops, out
  of autogenerate's sight.
- Apart: ``install()`` (or ``consumerdedup init-db``) manages them, and
  ``include_object(tables)`` keeps your autogenerate from ever touching them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import date
from typing import Any, Literal

from sqlalchemy import Connection, Table, text

from .db import catalog, mysql_types
from .db.names import fit_name
from .db.partitions import DayPartitions
from .schema import Tables, install

IncludeObject = Callable[[Any, str | None, str, bool, Any], bool]
"""The signature of Alembic's ``include_object`` hook."""


def include_object(
    tables: Tables, *, ours: bool = False, then: IncludeObject | None = None
) -> IncludeObject:
    """An ``include_object`` for ``context.configure``: leaves consumerdedup's objects out.

    By default (apart: install() manages them) the four tables, their indexes,
    constraints and columns, and processed_events' partitions; with ``ours=True``
    (together: your MetaData holds the tables) only the partitions. ``then`` is your
    own hook, asked about everything else.
    """
    owned = {(t.schema, t.name) for t in tables.owned}
    pe = tables.processed_events
    partition = re.compile(
        re.escape(DayPartitions(pe).name_for(date(2000, 1, 1))[:-8]) + r"\d{8}"
        f"|{re.escape(fit_name('', pe.name, 'default'))}"
    )

    def include(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
        table = obj if type_ == "table" else getattr(obj, "table", None)
        if isinstance(table, Table):
            schema = table.schema
            if schema == pe.schema and partition.fullmatch(table.name):
                return False
            if not ours and (schema, table.name) in owned:
                return False
        return then(obj, name, type_, reflected, compare_to) if then is not None else True

    return include


def create_schemas(bind: Connection, tables: Tables) -> None:
    """PostgreSQL: the tables' schemas that are missing (autogenerate writes none); first
    in upgrade(), before the ``create_table`` calls."""
    if bind.dialect.name != "postgresql":
        return
    for schema in sorted({t.schema for t in tables.owned if t.schema}):
        if not catalog.schema_exists(bind, schema):
            bind.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))


def upgrade_extras(bind: Connection, tables: Tables) -> None:
    """What autogenerate cannot produce, last in upgrade(): the NOTIFY trigger and its
    function, the DEFAULT and days-ahead partitions (partitioned), the schema version rows.

    It is ``install()`` run after your migration made the tables: it only adds what is
    missing, and fails with SchemaLocked rather than queue behind a held table lock.
    """
    install(bind, tables)


def downgrade_extras(bind: Connection, tables: Tables) -> None:
    """First in downgrade(), before the ``drop_table`` calls: the NOTIFY trigger and its
    function (dropping the tables drops their partitions and version rows)."""
    if bind.dialect.name != "postgresql":
        return
    if catalog.existing(bind, [tables.outbox]):
        with catalog.bounded(bind, tables.outbox, "drop its NOTIFY trigger"):
            bind.execute(text(tables.drop_trigger_sql()))
    bind.execute(text(tables.drop_function_sql()))


def render_item(type_: str, obj: Any, autogen_context: Any) -> Literal[False]:
    """A ``render_item`` for ``context.configure`` when consumerdedup's tables are on your
    MetaData: their MySQL column types (``consumerdedup.db.mysql_types``: the keys' binary
    NO PAD collation, DATETIME(6) in UTC) are written into the migration with their import.
    Every item is rendered as Alembic would (it returns False)."""
    if type_ == "type":
        variants = getattr(obj, "_variant_mapping", {}) or {}
        if any(type(t).__module__ == mysql_types.__name__ for t in (obj, *variants.values())):
            autogen_context.imports.add(f"import {mysql_types.__name__}")
    return False
