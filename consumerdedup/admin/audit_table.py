"""``AuditTable(engine)``: the audit trail as rows of the library's ``admin_audit`` table
(schema.audit_table), for ``admin_app(audit="table")`` or ``audit=AuditTable(...)``, and
read back, newest first in keyset pages, by the Audit page."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, insert, inspect, select
from sqlalchemy.exc import OperationalError

from ..errors import ConfigurationError
from ..options import instance, integer, maybe, text
from ..reasons import describe
from ..schema import DEFAULT, Tables
from ..schema.audit_table import admin_audit_table, audit_table_name
from .audit import NAMED, AuditEntry

log = logging.getLogger("consumerdedup.admin")
MAX_LIMIT = 500


@dataclass(frozen=True)
class AuditPage:
    rows: list[dict[str, Any]]
    before: int | None
    """The id to pass as ``before`` for the next (older) page; None at the end."""


class AuditTable:
    """Writes each AuditEntry as one row, in its own transaction, after the action ran.

    ``table``: its name (schema-qualified allowed), default ``admin_audit`` in
    processed_events' schema. The table must exist (``consumerdedup init-db
    --admin-audit``, or ``install()`` here): checked when made, since an action whose
    audit row cannot be written would be done unaudited.
    """

    def __init__(
        self, engine: Engine, *, tables: Tables = DEFAULT, table: str | None = None
    ) -> None:
        self.engine = instance(engine, "AuditTable(engine)", Engine, "a sqlalchemy Engine")
        instance(tables, "AuditTable(tables)", Tables, "a Tables")
        name = maybe(table, "AuditTable(table)", text) or audit_table_name(tables.processed_events)
        self.table = admin_audit_table(name)

    def install(self) -> AuditTable:
        """Create the table if it is missing (idempotent)."""
        from ..schema.audit_table import install_audit

        install_audit(self.engine, self.table)
        return self

    def check(self) -> AuditTable:
        """ConfigurationError naming the fix if the table is missing. A database that
        cannot be reached yet is logged, not raised: a service started before its database
        (``consumerdedup run``) waits for it, and a write to a missing table fails the
        action's page then."""
        try:
            with self.engine.connect() as conn:
                found = inspect(conn).has_table(self.table.name, schema=self.table.schema)
        except OperationalError as error:
            log.warning("admin audit table %s not checked: %s", self.table.fullname,
                        describe(error))  # fmt: skip
            return self
        if not found:
            raise ConfigurationError(
                f"the admin audit table {self.table.fullname} does not exist: run "
                "`consumerdedup init-db --admin-audit` (or AuditTable(engine).install())"
            )
        return self

    def __call__(self, entry: AuditEntry) -> None:
        values = {
            **entry.as_dict(),
            "at": entry.at,
            "who": entry.who[:255],
            "target": json.dumps(entry.target, default=str, sort_keys=True),
            "ids": json.dumps(list(entry.ids[:NAMED])),
        }
        with self.engine.begin() as conn:
            conn.execute(insert(self.table).values(**values))

    def recent(self, limit: int = 50, before: int | None = None) -> AuditPage:
        """The newest ``limit`` rows older than id ``before`` (an index scan of the key)."""
        integer(limit, "limit", at_least=1, at_most=MAX_LIMIT)
        maybe(before, "before", integer, at_least=1)
        t = self.table
        query = select(t).order_by(t.c.id.desc()).limit(limit + 1)
        if before is not None:
            query = query.where(t.c.id < before)
        with self.engine.connect() as conn:
            found = [dict(r._mapping) for r in conn.execute(query)]
        rows = [
            {**r, "target": json.loads(r["target"]), "ids": json.loads(r["ids"])}
            for r in found[:limit]
        ]
        more = len(found) > limit
        return AuditPage(rows, rows[-1]["id"] if more and rows else None)

    def __repr__(self) -> str:
        return f"AuditTable({self.table.fullname!r})"
