"""The SQL the pipeline runs: one set of Core statements for sync and async, both dialects."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Integer, Select, String, TextualSelect, bindparam, select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql.dml import Insert

from .errors import ConfigurationError
from .schema import Tables

SUPPORTED_DIALECTS = ("postgresql", "sqlite")
CLAIM_LOCKS = 0x0C10
"""Advisory-lock namespace of claims on a partitioned processed_events (first int of the key)."""


@dataclass(frozen=True, slots=True)
class Recorded:
    """A processed_events row as the lookup returns it."""

    payload_hash: str
    outcome: str
    error: str | None


def utcnow() -> datetime:
    return datetime.now(UTC)


class Statements:
    """Statements bound to one table set and one dialect; built once, cached by SQLAlchemy."""

    def __init__(self, tables: Tables, dialect: str) -> None:
        if dialect not in SUPPORTED_DIALECTS:
            raise ConfigurationError(
                f"unsupported database {dialect!r}: consumerdedup runs on "
                + " and ".join(SUPPORTED_DIALECTS)
            )
        pe = tables.processed_events
        self.tables = tables
        self.dialect = dialect
        self._lookup: Select[Any] = select(
            pe.c.message_id, pe.c.payload_hash, pe.c.outcome, pe.c.error
        ).where(
            pe.c.consumer == bindparam("consumer"),
            pe.c.message_id.in_(bindparam("keys", expanding=True)),
        )
        self.serialized = tables.partitioned
        """Claims serialize on advisory locks and a lookup: no unique key to conflict on."""
        insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
        if self.serialized:
            if dialect != "postgresql":
                raise ConfigurationError("a partitioned processed_events needs PostgreSQL")
            self._record = insert(pe).returning(pe.c.message_id)
        else:
            self._record = (
                insert(pe)
                .on_conflict_do_nothing(index_elements=[pe.c.consumer, pe.c.message_id])
                .returning(pe.c.message_id)
            )
        # Locks in hash order, so two batches sharing keys cannot deadlock; the ordered
        # subquery is not flattened, so the locks are taken in that order.
        self._lock: TextualSelect = (
            text(
                "SELECT current_setting('transaction_isolation') AS isolation, count(*) AS locked "
                "FROM (SELECT pg_advisory_xact_lock(:ns, h) FROM (SELECT DISTINCT "
                "hashtext(:consumer || '/' || k) AS h FROM unnest(CAST(:keys AS text[])) AS k "
                "ORDER BY h) AS hashes) AS locks"
            )
            .bindparams(bindparam("consumer", type_=String()))
            .columns(isolation=String(), locked=Integer())
        )

    def lookup(self, consumer: str, keys: Sequence[str]) -> tuple[Select[Any], dict[str, Any]]:
        return self._lookup, {"consumer": consumer, "keys": list(keys)}

    @staticmethod
    def read_lookup(rows: Iterable[Any]) -> dict[str, Recorded]:
        return {key: Recorded(digest, outcome, error) for key, digest, outcome, error in rows}

    def record(self, rows: Iterable[Mapping[str, Any]]) -> tuple[Insert, list[dict[str, Any]]]:
        """INSERT ... ON CONFLICT DO NOTHING RETURNING message_id: what comes back was ours.

        Serialized (partitioned): a plain INSERT, of keys the lock and lookup found free.
        """
        return self._record, [dict(r) for r in rows]

    @staticmethod
    def read_recorded(rows: Iterable[Any]) -> set[str]:
        return {key for (key,) in rows}

    def lock(self, consumer: str, keys: Sequence[str]) -> tuple[TextualSelect, dict[str, Any]]:
        """Serialized claims: lock (consumer, key) until the transaction ends.

        A twin's claim waits here until the holder commits or rolls back; the
        lookup that follows, a new statement with a new snapshot under READ
        COMMITTED, then sees the holder's row.
        """
        return self._lock, {"ns": CLAIM_LOCKS, "consumer": consumer, "keys": list(keys)}

    @staticmethod
    def read_lock(rows: Any) -> None:
        isolation = rows.one().isolation
        if isolation != "read committed":
            # One snapshot for the whole transaction would hide a twin's committed claim.
            raise ConfigurationError(
                "a partitioned processed_events needs READ COMMITTED transactions, "
                f"not {isolation.upper()}: the lookup after the claim lock must see "
                "what the previous holder committed"
            )

    @staticmethod
    def mismatch(error: BaseException) -> ConfigurationError | None:
        """A ConfigurationError if ``error`` says the table is partitioned but Tables is not."""
        if getattr(getattr(error, "orig", None), "sqlstate", None) != "42P10":
            return None  # 42P10: no unique key matches the ON CONFLICT columns
        return ConfigurationError(
            "processed_events has no unique (consumer, message_id): if it is partitioned, "
            "define the tables with Tables.define(..., partitioned=True)"
        )
