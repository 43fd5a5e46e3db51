"""Advisory locks namespaced by the table they guard (PostgreSQL).

A database has one advisory-lock space, shared by every table and every
application. Our locks take the two-int form: the first int is the lock's
class, a hash of what it is for and of the table's OID (so ``outbox`` reached
through search_path and ``myschema.outbox`` are one table, and two outboxes
in two schemas are two); the second int is the key. The same key in
unrelated tables then never blocks, while every name of one table does.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Integer, ScalarSelect, Table, column, text

from .names import table_sql

PRODUCER = "outbox.add"
RELAY = "outbox.relay"
CLAIM = "claim"
PRUNER = "prune"

SPACE_SQL = (
    "(SELECT hashtext(CAST(:lock_purpose AS text) || ':' "
    "|| CAST(CAST(CAST(:lock_table AS text) AS regclass) AS oid)))"
)
"""The class (first int) of a lock, as SQL with :lock_purpose and :lock_table. A subquery,
so PostgreSQL works it out once per statement, not once per key; a missing table is an
error here rather than a NULL class, which would lock nothing."""


def space_params(purpose: str, table: Table) -> dict[str, str]:
    """The parameters of SPACE_SQL for ``purpose`` on ``table``."""
    return {"lock_purpose": purpose, "lock_table": table_sql(table)}


def space(purpose: str, table: Table) -> ScalarSelect[Any]:
    """SPACE_SQL as a Core expression, its parameters bound."""
    query = text(SPACE_SQL[1:-1]).bindparams(**space_params(purpose, table))
    return query.columns(column("space", Integer)).scalar_subquery()
