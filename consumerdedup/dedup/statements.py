"""The SQL the pipeline runs: one set of Core statements for sync and async, both dialects."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Delete, Select, TextualSelect, bindparam, delete, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql.dml import Insert

from ..db.dialects import is_mysql, require_supported
from ..db.names import table_sql
from ..errors import ConfigurationError
from ..outcome import Outcome
from ..reasons import describe
from ..retry import setup_fault
from ..schema import Tables
from . import partitioned_statements
from .driver_sql import DriverSQL
from .mysql_claim import ClaimCount, KeyedInsert

MAX_PARAMETERS = 30_000
"""Bound parameters per statement of ours, under every supported driver's limit:
psycopg's 65,535, asyncpg's 32,767, SQLite's 32,766 (SQLITE_MAX_VARIABLE_NUMBER since
3.32; the claim's RETURNING needs 3.35). A batch of any size is cut to fit."""
_RECORD_COLUMNS = 6
_PROCESSED = Outcome.PROCESSED.value
"""Parameters per row of the VALUES form of ``record``."""


@dataclass(frozen=True, slots=True)
class Recorded:
    """A processed_events row as the lookup returns it."""

    payload_hash: str
    outcome: str
    error: str | None


class Statements:
    """Statements bound to one table set and one dialect; built once, cached by SQLAlchemy."""

    def __init__(self, tables: Tables, dialect: str) -> None:
        require_supported(dialect)
        pe = tables.processed_events
        self.tables = tables
        self.dialect = dialect
        self._lookup: Select[Any] | TextualSelect = select(
            pe.c.message_id, pe.c.payload_hash, pe.c.outcome, pe.c.error
        ).where(
            pe.c.consumer == bindparam("consumer"),
            pe.c.message_id.in_(bindparam("keys", expanding=True)),
        )
        self.serialized = tables.partitioned
        """Claims serialize on advisory locks: a partitioned table has no key to conflict on."""
        self.mysql = is_mysql(dialect)
        """MySQL/MariaDB: the claim is a plain INSERT (mysql_claim), and its rows are
        verified ours right before COMMIT (``holds``): InnoDB's deadlock rolls the whole
        transaction back and the next statement silently opens a new one. Both go to the
        driver as text built once (mysql_claim), as the psycopg statements do."""
        insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
        mysql_name = table_sql(pe, "mysql")
        self._record: Insert | TextualSelect | KeyedInsert = (
            KeyedInsert(mysql_name)
            if self.mysql
            else insert(pe)
            .on_conflict_do_nothing(index_elements=[pe.c.consumer, pe.c.message_id])
            .returning(pe.c.message_id)
        )
        self._holds = ClaimCount(mysql_name, _PROCESSED)
        if self.serialized:
            if dialect != "postgresql":
                raise ConfigurationError("a partitioned processed_events needs PostgreSQL")
            self._lookup = partitioned_statements.lookup(pe)
            self._record = partitioned_statements.record(pe)
        self._lock = partitioned_statements.lock(pe)
        self._unclaim: Delete = delete(pe).where(
            pe.c.consumer == bindparam("consumer"),
            pe.c.message_id.in_(bindparam("keys", expanding=True)),
            pe.c.processed_at == bindparam("claimed_at"),
            pe.c.outcome == _PROCESSED,
            pe.c.error.is_(None),
        )
        """Undo an attempt's claims (``unclaims``); off the hot path, so plain Core."""
        self.on_driver = dialect == "postgresql" and not self.serialized
        """The claim, lookup and records go to psycopg itself (driver_sql), keys as arrays:
        one statement whatever the batch's size."""
        name = table_sql(pe)
        self._driver_lookup = DriverSQL(
            f"SELECT message_id, payload_hash, outcome, error FROM {name} "
            "WHERE consumer = %(consumer)s AND message_id = ANY(%(keys)s::text[])"
        )
        self._driver_record = DriverSQL(
            f"INSERT INTO {name} (consumer, message_id, processed_at, payload_hash, outcome, "
            "error) SELECT %(consumer)s, r.message_id, %(processed_at)s, r.payload_hash, "
            "r.outcome, r.error FROM unnest(%(ids)s::text[], %(hashes)s::text[], "
            "%(outcomes)s::text[], %(errors)s::text[]) WITH ORDINALITY "
            "AS r(message_id, payload_hash, outcome, error, n) ORDER BY r.n "
            "ON CONFLICT (consumer, message_id) DO NOTHING RETURNING message_id"
        )
        self._driver_claim = DriverSQL(
            f"INSERT INTO {name} (consumer, message_id, processed_at, payload_hash, outcome, "
            "error) SELECT %(consumer)s, r.message_id, %(processed_at)s, r.payload_hash, "
            f"'{Outcome.PROCESSED.value}', NULL FROM unnest(%(ids)s::text[], "
            "%(hashes)s::text[]) WITH ORDINALITY AS r(message_id, payload_hash, n) "
            "ORDER BY r.n ON CONFLICT (consumer, message_id) DO NOTHING RETURNING message_id"
        )
        """Rows that are all PROCESSED with no error (a claim): two arrays, not four, for
        psycopg to build and the server to read."""
        self._driver_record_one = DriverSQL(
            f"INSERT INTO {name} (consumer, message_id, processed_at, payload_hash, outcome, "
            "error) VALUES (%(consumer)s, %(message_id)s, %(processed_at)s, %(payload_hash)s, "
            "%(outcome)s, %(error)s) "
            "ON CONFLICT (consumer, message_id) DO NOTHING RETURNING message_id"
        )
        """One row (a message alone): plain values, which psycopg binds for half the CPU
        of the arrays (measured: 49 against 82 us a claim, SQLAlchemy's 189, loaded box)."""

    def lookups(
        self, consumer: str, keys: Sequence[str]
    ) -> list[tuple[Select[Any] | TextualSelect | DriverSQL, dict[str, Any]]]:
        """The lookup of ``keys``, in as many statements as the parameter limit needs.

        On PostgreSQL the keys travel as one array: a single statement.
        """
        if self.on_driver:
            return [(self._driver_lookup, {"consumer": consumer, "keys": list(keys)})]
        size = len(keys) if self.serialized else MAX_PARAMETERS - 1
        return [
            (self._lookup, {"consumer": consumer, "keys": list(keys[i : i + size])})
            for i in range(0, len(keys), max(size, 1))
        ]

    @staticmethod
    def read_lookup(rows: Iterable[Any]) -> dict[str, Recorded]:
        return {key: Recorded(digest, outcome, error) for key, digest, outcome, error in rows}

    def records(
        self, rows: Iterable[Mapping[str, Any]]
    ) -> list[tuple[Insert | TextualSelect | DriverSQL | KeyedInsert, Any]]:
        """INSERT ... ON CONFLICT DO NOTHING RETURNING message_id: what comes back was ours.

        The rows go in key order, in as many statements as the parameter limit needs:
        two batches sharing keys then take the keys' locks in one order and wait on each
        other instead of deadlocking. Serialized (partitioned): one INSERT of the keys no
        partition holds, after ``lock`` (which takes its locks in hash order).
        """
        listed = sorted((dict(r) for r in rows), key=lambda row: row["message_id"])
        if self.on_driver and len(listed) == 1:
            return [(self._driver_record_one, listed[0])]
        if self.on_driver:  # in array order, so the keys' locks are taken in key order
            params = partitioned_statements.record_params(listed)
            if all(o == _PROCESSED for o in params["outcomes"]) and not any(params["errors"]):
                del params["outcomes"], params["errors"]
                return [(self._driver_claim, params)]
            return [(self._driver_record, params)]
        if self.serialized:
            return [(self._record, partitioned_statements.record_params(listed))]
        if self.mysql:  # in key order, cut to size by KeyedInsert itself
            return [(self._record, listed)]
        size = MAX_PARAMETERS // _RECORD_COLUMNS
        return [(self._record, listed[i : i + size]) for i in range(0, len(listed), size)]

    @staticmethod
    def read_recorded(rows: Iterable[Any]) -> set[str]:
        return {key for (key,) in rows}

    def unclaims(
        self, consumer: str, keys: Sequence[str], claimed_at: datetime
    ) -> list[tuple[Delete, dict[str, Any]]]:
        """DELETE the claims one attempt made: its keys, and only rows it wrote itself.

        A claim row is (consumer, key, claimed_at, the payload's hash, PROCESSED, no
        error), ``claimed_at`` being the one time stamp of the attempt's claim statement.
        While that row exists the key's primary key keeps any other row out, so a row
        of the key written by anyone else (a twin runner that claimed it after ours was
        deleted, say by ``forget``) is told apart by its own time stamp; it is touched only
        if it was stamped in the very same microsecond. Rows of other consumers are never
        touched (``consumer``). In as many statements as the parameter limit needs.
        """
        size = MAX_PARAMETERS - 4
        return [
            (
                self._unclaim,
                {"consumer": consumer, "keys": list(keys[i : i + size]), "claimed_at": claimed_at},
            )
            for i in range(0, len(keys), size)
        ]

    def holds(
        self, consumer: str, keys: Sequence[str], claimed_at: datetime
    ) -> list[tuple[ClaimCount, dict[str, Any]]]:
        """COUNT the claims of ``keys`` stamped ``claimed_at`` this transaction sees: all of
        them while it is the one that wrote them; fewer in a new transaction that began after
        InnoDB rolled ours back (its snapshot has no uncommitted row of ours; a twin's row
        has the twin's own stamp). The stamp is the attempt's token (see ``unclaims``)."""
        size = MAX_PARAMETERS - 4
        return [
            (
                self._holds,
                {"consumer": consumer, "keys": list(keys[i : i + size]), "claimed_at": claimed_at},
            )
            for i in range(0, len(keys), size)
        ]

    @staticmethod
    def read_scalar(rows: Any) -> int:
        """The one value of a one-row answer (a driver's rows, mysql_claim)."""
        ((value,),) = rows
        return int(value)

    @staticmethod
    def read_count(result: Any) -> int:
        return int(result.rowcount)

    def lock(self, consumer: str, keys: Sequence[str]) -> tuple[TextualSelect, dict[str, Any]]:
        """Serialized claims: lock (consumer, key) on this table until the transaction ends.

        A twin's claim waits here until the holder commits or rolls back; the
        INSERT that follows, a new statement with a new snapshot under READ
        COMMITTED, then sees the holder's row and skips the key.
        """
        return self._lock, {"consumer": consumer, "keys": list(keys)}

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
    def misconfigured(error: BaseException) -> ConfigurationError | None:
        """A ConfigurationError if one of our statements failed because of the setup, not
        the message: the table is missing or does not match ``Tables``, the role may not
        use it, the database is read-only (a standby). Raised to the caller instead of
        failing, or dead-lettering, every message in turn.
        """
        orig = getattr(error, "orig", None)
        state = getattr(orig, "sqlstate", None)
        text = describe(orig) if orig is not None else describe(error)
        if state == "42P10":  # no unique key matches the ON CONFLICT columns
            return ConfigurationError(
                "processed_events has no unique (consumer, message_id): if it is partitioned, "
                "define the tables with Tables.define(..., partitioned=True)"
            )
        if state == "23514" and "no partition of relation" in str(orig):
            return ConfigurationError(
                f"processed_events has no partition for this row ({text}): run install() "
                "or `consumerdedup init-db --partitioned` to make the DEFAULT partition"
            )
        if setup_fault(error):
            return ConfigurationError(
                f"processed_events cannot be used as configured ({text}): check the tables "
                "(install() or `consumerdedup init-db`), the role's rights and that the "
                "database accepts writes"
            )
        return None
