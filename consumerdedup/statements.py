"""The SQL the pipeline runs: one set of Core statements for sync and async, both dialects."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Select, bindparam, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql.dml import Insert

from .errors import ConfigurationError
from .schema import Tables

SUPPORTED_DIALECTS = ("postgresql", "sqlite")


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
        insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
        self._record: Insert = (
            insert(pe)
            .on_conflict_do_nothing(index_elements=[pe.c.consumer, pe.c.message_id])
            .returning(pe.c.message_id)
        )

    def lookup(self, consumer: str, keys: Sequence[str]) -> tuple[Select[Any], dict[str, Any]]:
        return self._lookup, {"consumer": consumer, "keys": list(keys)}

    @staticmethod
    def read_lookup(rows: Iterable[Any]) -> dict[str, Recorded]:
        return {key: Recorded(digest, outcome, error) for key, digest, outcome, error in rows}

    def record(self, rows: Iterable[Mapping[str, Any]]) -> tuple[Insert, list[dict[str, Any]]]:
        """INSERT ... ON CONFLICT DO NOTHING RETURNING message_id: what comes back was ours."""
        return self._record, [dict(r) for r in rows]

    @staticmethod
    def read_recorded(rows: Iterable[Any]) -> set[str]:
        return {key for (key,) in rows}
