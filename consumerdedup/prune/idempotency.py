"""Which idempotency_keys rows the pruner deletes, and the bounded batches that delete them.

A completed record (or one that ran but was not stored) has lived out its life once
its stored ``expires_at`` has passed: the middleware already treats it as absent (the
same key is a new request). ``keep`` (``prune --idempotency-keep 24h``) shortens that
life for every key: a record created more than ``keep`` ago goes too, whatever expiry
it was stored with. An in-flight claim is never deleted while its lease holds (two
requests with one key must never run at once); one whose lease ran out (its worker
died and no retry came) goes once it is older than ``keep``, or than
ABANDONED_KEEP when records keep their own expiry.

Each batch deletes at most ``limit`` rows by physical address (ctid, rowid; MySQL and
MariaDB: ``DELETE ... LIMIT``), the rows
chosen with the time bound bound as a parameter, so no statement holds a long lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import BindParameter, Connection, DateTime, Integer, Table, bindparam, inspect, text

from ..db.names import table_sql

EXPIRY = "expiry"
"""``idempotency_keep=EXPIRY`` (the default): each record's own stored expiry decides."""
ABANDONED_KEEP = timedelta(hours=24)
"""How long an in-flight claim whose lease ran out is kept when no ``keep`` is given: the
middleware's default expiry (a record past it would be a new request anyway)."""
IN_FLIGHT = "in_flight"  # the state the SQL store writes for a claim (http/sql_statements.py)


@dataclass(frozen=True)
class KeyCutoffs:
    """One round's bounds: ``now``; ``created`` (keep given: older records go)."""

    now: datetime
    created: datetime | None
    abandoned: datetime

    @classmethod
    def at(cls, now: datetime, keep: timedelta | None) -> KeyCutoffs:
        created = None if keep is None else now - keep
        return cls(now, created, now - (keep if keep is not None else ABANDONED_KEEP))

    def params(self) -> dict[str, Any]:
        return {"k_now": self.now, "k_created": self.created, "k_abandoned": self.abandoned}


class KeyPruneStatements:
    """The pruner's statements over one idempotency_keys table, for one dialect.

    Two kinds of batch: past their stored expiry (in-flight claims have none, so it never
    matches them; the expires_at index finds the rows), and, when ``keep`` is given or for
    abandoned claims, by age (no index: a scan, but such rows are few and the batch stops
    at ``limit``).
    """

    def __init__(self, table: Table, dialect: str) -> None:
        self.table = table
        self.postgres = dialect == "postgresql"
        name = table_sql(table, dialect)
        stamp = DateTime(timezone=True)
        binds: list[BindParameter[Any]] = [
            bindparam("k_now", type_=stamp),
            bindparam("k_created", type_=stamp),
            bindparam("k_abandoned", type_=stamp),
            bindparam("limit", type_=Integer()),
        ]
        expired = "expires_at <= :k_now"
        # A NULL k_created (no keep) matches nothing: then only abandoned claims go by age.
        old = (
            f"(state <> '{IN_FLIGHT}' AND created_at < :k_created) OR (state = '{IN_FLIGHT}' "
            "AND locked_until <= :k_now AND created_at < :k_abandoned)"
        )

        def delete(condition: str) -> Any:
            if dialect in ("mysql", "mariadb"):  # no ctid; no subquery on the deleted table
                sql = f"DELETE FROM {name} WHERE {condition} LIMIT :limit"
                return text(sql).bindparams(*[b for b in binds if f":{b.key}" in sql])
            page = f"SELECT {'ctid' if self.postgres else 'rowid'} FROM {name} WHERE {condition}"
            page += " LIMIT :limit"
            chosen = f"ctid = ANY(ARRAY({page}))" if self.postgres else f"rowid IN ({page})"
            # The condition again: a row reclaimed by a new request since the page was read
            # (an UPDATE in place) no longer matches and stays.
            sql = f"DELETE FROM {name} WHERE {chosen} AND ({condition})"
            return text(sql).bindparams(*[b for b in binds if f":{b.key}" in sql])

        self._deletes = (delete(expired), delete(old))
        count = f"SELECT count(*) FROM {name} WHERE ({expired}) OR {old}"
        self._count = text(count).bindparams(*[b for b in binds if b.key != "limit"])

    def exists(self, conn: Connection) -> bool:
        """Databases installed before idempotency keys existed have no such table."""
        return bool(inspect(conn).has_table(self.table.name, schema=self.table.schema))

    def delete_batch(self, conn: Connection, cutoffs: KeyCutoffs, limit: int, kind: int) -> int:
        """One batch of kind 0 (past the stored expiry) or 1 (by age)."""
        params = {**cutoffs.params(), "limit": limit}
        return int(conn.execute(self._deletes[kind], params).rowcount)

    @property
    def kinds(self) -> range:
        return range(len(self._deletes))

    def count(self, conn: Connection, cutoffs: KeyCutoffs) -> int:
        return int(conn.execute(self._count, cutoffs.params()).scalar_one())
