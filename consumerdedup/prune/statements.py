"""The pruner's SQL: bounded batch deletes that walk the processed_at index once per round.

A batch takes the oldest expired rows in processed_at order (the index the
table has for this), deletes them by physical address (ctid on PostgreSQL,
rowid on SQLite; on MySQL and MariaDB a ``DELETE ... ORDER BY ... LIMIT`` of the
rows a locking read of the same order just took) and reports the newest
processed_at it deleted. The next
batch starts from there, so rows a longer window protects are read once per
round, not once per batch. Every selected row is deletable, so a batch either
deletes something or ends the round: no loop can stall on protected rows.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    BindParameter,
    Connection,
    DateTime,
    Integer,
    String,
    bindparam,
    text,
)

from ..db import locks
from ..db.names import table_sql
from ..schema import Tables

EARLIEST = datetime(1, 1, 2, tzinfo=UTC)


@dataclass(frozen=True)
class Batch:
    deleted: Counter[str]
    """Rows deleted per consumer."""
    last: datetime | None
    """The newest processed_at deleted: where the next batch starts."""

    @property
    def total(self) -> int:
        return sum(self.deleted.values())


def _utc(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


class PruneStatements:
    """Statements for one table set, one dialect and one set of consumer windows.

    ``named`` are the consumers with a window of their own (None: kept forever);
    ``others`` says whether every consumer not named is pruned with the default
    cutoff too. Cutoffs are bound per round, in ``params``.
    """

    def __init__(self, tables: Tables, dialect: str, named: Sequence[str], others: bool) -> None:
        self.postgres = dialect == "postgresql"
        self.mysql = dialect in ("mysql", "mariadb")
        self.named = list(named)
        self.others = others
        pe, ob = tables.processed_events, tables.outbox
        self._lock_params = locks.space_params(locks.PRUNER, pe)
        pe_name, ob_name = table_sql(pe, dialect), table_sql(ob, dialect)
        stamp = DateTime(timezone=True)
        self._binds: list[BindParameter[Any]] = [
            bindparam("upper", type_=stamp),
            bindparam("lower", type_=stamp),
            bindparam("default_cutoff", type_=stamp),
            *[bindparam(f"cutoff_{i}", type_=stamp) for i in range(len(self.named))],
            *[bindparam(f"consumer_{i}", type_=String()) for i in range(len(self.named))],
        ]
        expired = f"processed_at < :upper AND {self._window_condition()}"
        self._count = self._text(
            f"SELECT consumer, count(*) AS n FROM {pe_name} WHERE {expired} GROUP BY consumer",
            consumer=String(),
            n=Integer(),
        )
        if self.postgres:
            # On a partitioned table a ctid names a row in each partition: the guard keeps
            # any extra match to expired rows, and the next batch starts from the newest row
            # selected (not deleted), so an extra match never makes a batch skip rows.
            self._batch = self._text(
                f"WITH batch AS (SELECT ctid, processed_at FROM {pe_name} WHERE {expired} "
                "AND processed_at >= :lower ORDER BY processed_at LIMIT :limit), "
                f"gone AS (DELETE FROM {pe_name} WHERE ctid = ANY(ARRAY(SELECT ctid FROM batch)) "
                f"AND {expired} RETURNING consumer) "
                "SELECT consumer, count(*) AS n, (SELECT max(processed_at) FROM batch) AS last "
                "FROM gone GROUP BY consumer",
                consumer=String(),
                n=Integer(),
                last=stamp,
            )
        elif self.mysql:
            # No ctid, no DML in WITH, no LIMIT in an IN subquery, no RETURNING on MariaDB's
            # DELETE before 10.5 nor MySQL's: the batch's rows are read and row-locked in the
            # index's order (the primary key breaks ties, so the order is total), counted
            # here, then deleted by the same ORDER BY and LIMIT: the same rows.
            order = f"WHERE {expired} AND processed_at >= :lower ORDER BY processed_at, " + (
                "consumer, message_id LIMIT :limit"
            )
            self._batch = self._text(
                f"SELECT consumer, processed_at FROM {pe_name} {order} FOR UPDATE",
                consumer=String(),
                processed_at=stamp,
            )
            self._batch_delete = self._text(f"DELETE FROM {pe_name} {order}")
        else:  # SQLite has no DML in WITH: the rows come back and are counted here
            self._batch = self._text(
                f"DELETE FROM {pe_name} WHERE rowid IN (SELECT rowid FROM {pe_name} "
                f"WHERE {expired} AND processed_at >= :lower ORDER BY processed_at "
                "LIMIT :limit) RETURNING consumer, processed_at",
                consumer=String(),
                processed_at=stamp,
            )
        # Unpublished rows have published_at NULL, which no comparison matches.
        published = "published_at IS NOT NULL AND published_at < :outbox_cutoff"
        page = f"SELECT id FROM {ob_name} WHERE {published} ORDER BY published_at LIMIT :limit"
        ids = f"id = ANY(ARRAY({page}))" if self.postgres else f"id IN ({page})"
        if self.mysql:  # it refuses a subquery on the table a DELETE deletes from
            ids = f"{published} ORDER BY published_at LIMIT :limit"
        outbox_cutoff = bindparam("outbox_cutoff", type_=stamp)
        self._outbox_delete = text(f"DELETE FROM {ob_name} WHERE {ids}").bindparams(outbox_cutoff)
        self._outbox_count = text(f"SELECT count(*) FROM {ob_name} WHERE {published}").bindparams(
            outbox_cutoff
        )
        # Abandoned rows (never published) go like published ones, by abandoned_at; they are
        # among the few unpublished rows, which the relay's partial index on id serves.
        gone = "published_at IS NULL AND abandoned_at < :outbox_cutoff"
        page = f"SELECT id FROM {ob_name} WHERE {gone} ORDER BY id LIMIT :limit"
        ids = f"id = ANY(ARRAY({page}))" if self.postgres else f"id IN ({page})"
        if self.mysql:
            ids = f"{gone} ORDER BY id LIMIT :limit"
        self._abandoned_delete = text(f"DELETE FROM {ob_name} WHERE {ids}").bindparams(
            outbox_cutoff
        )
        self._abandoned_count = text(f"SELECT count(*) FROM {ob_name} WHERE {gone}").bindparams(
            outbox_cutoff
        )
        self._consumer_rows = text(
            f"SELECT 1 FROM {pe_name} WHERE consumer = :consumer LIMIT 1"
        ).bindparams(bindparam("consumer", type_=String()))
        self._consumers = text(f"SELECT DISTINCT consumer FROM {pe_name} ORDER BY consumer")

    def _window_condition(self) -> str:
        """Each consumer's rows against its own cutoff; a NULL cutoff (forever) matches nothing."""
        if not self.named:
            return "processed_at < :default_cutoff" if self.others else "1 = 0"
        whens = " ".join(f"WHEN :consumer_{i} THEN :cutoff_{i}" for i in range(len(self.named)))
        otherwise = ":default_cutoff" if self.others else "NULL"
        condition = f"processed_at < CASE consumer {whens} ELSE {otherwise} END"
        if not self.others:  # lets the planner use the primary key when that is cheaper
            names = ", ".join(f":consumer_{i}" for i in range(len(self.named)))
            condition = f"consumer IN ({names}) AND {condition}"
        return condition

    def _text(self, sql: str, **columns: Any) -> Any:
        used = [b for b in self._binds if f":{b.key}" in sql]
        return text(sql).bindparams(*used).columns(**columns)

    def params(
        self, cutoffs: Mapping[str, datetime | None], default: datetime | None
    ) -> dict[str, Any]:
        """Bind values for one round; ``upper`` is the latest cutoff of all (the index bound)."""
        values: dict[str, Any] = {"default_cutoff": default, "lower": EARLIEST}
        for i, name in enumerate(self.named):
            values[f"consumer_{i}"] = name
            values[f"cutoff_{i}"] = cutoffs.get(name)
        live = [c for c in [*cutoffs.values(), default if self.others else None] if c is not None]
        values["upper"] = max(live) if live else None
        return values

    def delete_batch(self, conn: Connection, params: Mapping[str, Any], limit: int) -> Batch:
        rows = conn.execute(self._batch, {**params, "limit": limit}).all()
        if self.mysql and rows:
            conn.execute(self._batch_delete, {**params, "limit": limit})
        deleted: Counter[str] = Counter()
        last: datetime | None = None
        if self.postgres:
            for consumer, n, newest in rows:
                deleted[consumer] += n
                last = newest if last is None else max(last, newest)
        else:
            for consumer, processed_at in rows:
                deleted[consumer] += 1
                last = processed_at if last is None else max(last, processed_at)
        return Batch(deleted, None if last is None else _utc(last))

    def count(self, conn: Connection, params: Mapping[str, Any]) -> Counter[str]:
        return Counter({consumer: int(n) for consumer, n in conn.execute(self._count, params)})

    def delete_outbox(self, conn: Connection, cutoff: datetime, limit: int) -> int:
        """Up to ``limit`` rows published, or abandoned, before ``cutoff``."""
        result = conn.execute(self._outbox_delete, {"outbox_cutoff": cutoff, "limit": limit})
        deleted = int(result.rowcount)
        if deleted < limit:
            params = {"outbox_cutoff": cutoff, "limit": limit - deleted}
            deleted += int(conn.execute(self._abandoned_delete, params).rowcount)
        return deleted

    def count_outbox(self, conn: Connection, cutoff: datetime) -> int:
        params = {"outbox_cutoff": cutoff}
        published = conn.execute(self._outbox_count, params).scalar_one()
        return int(published) + int(conn.execute(self._abandoned_count, params).scalar_one())

    def try_lock(self, conn: Connection) -> bool:
        """The session lock that keeps other pruners of this processed_events off the round."""
        statement = text(f"SELECT pg_try_advisory_lock({locks.SPACE_SQL}, 0)")
        return bool(conn.execute(statement, self._lock_params).scalar())

    def unlock(self, conn: Connection) -> None:
        statement = text(f"SELECT pg_advisory_unlock({locks.SPACE_SQL}, 0)")
        conn.execute(statement, self._lock_params)

    def has_records(self, conn: Connection, consumer: str) -> bool:
        return conn.execute(self._consumer_rows, {"consumer": consumer}).first() is not None

    def consumers(self, conn: Connection) -> list[str]:
        return list(conn.execute(self._consumers).scalars())
