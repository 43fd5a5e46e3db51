"""Outbox.add: an outgoing event that exists if and only if the caller's transaction commits."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Awaitable, Mapping
from typing import Any, overload

from sqlalchemy import Connection, String, Table, bindparam, func, insert, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from ..db import before_commit, dialects, locks
from ..errors import ConfigurationError, TransactionBroken
from ..headers import ID_HEADER
from ..options import instance
from ..schema import DEFAULT, ID_LENGTH, Tables, utcnow
from ..telemetry import hooks
from . import wakeup
from .held_back import hold_back
from .mysql import KeyLocks, is_mysql

_ADD = "Outbox.add"
_clock = threading.Lock()
_last = [0, 0]  # millisecond, counter


def new_event_id() -> str:
    """A UUIDv7 (RFC 9562): unique, and in this process sortable by creation order.

    Within one millisecond a 12-bit counter (the RFC's method 1) keeps the order.
    """
    with _clock:
        millis = max(time.time_ns() // 1_000_000, _last[0])
        counter = _last[1] + 1 if millis == _last[0] else 0
        if counter > 0xFFF:
            millis, counter = millis + 1, 0
        _last[:] = [millis, counter]
    random_bits = int.from_bytes(os.urandom(8)) & (2**62 - 1)
    value = (millis & (2**48 - 1)) << 80 | 0x7 << 76 | counter << 64 | 0x2 << 62 | random_bits
    return str(uuid.UUID(int=value))


class Outbox:
    """Adds outgoing events to the outbox table inside the caller's transaction.

    Per-key order: on PostgreSQL, ``add`` takes a transaction-scoped advisory
    lock on the key in this outbox table, so two transactions adding events
    with the same key commit in the order their rows were numbered. The relay
    publishes a key's events in that order; events without a key carry no
    order promise. Inside a dedup handler the keyed rows are held back to just
    before the pipeline's COMMIT, and a batch's keys are locked then, in one order
    (db/before_commit.py): two batches over the same keys cannot deadlock on them.
    A session in autocommit mode is refused (ConfigurationError):
    its row would commit alone, whatever became of the caller's transaction.
    In a pipeline transaction whose driver says it is over (a handler ended it through
    the raw DB-API connection), ``add`` raises TransactionBroken saying so: the
    pipeline's connection runs in driver autocommit for its pipelined BEGIN
    (db.pipelined_begin), so the autocommit check alone would blame the engine.

    On MySQL and MariaDB ``add`` row-locks the key's bucket in the outbox's key-lock table
    at once, until the transaction ends (outbox.mysql says why not GET_LOCK); and once the
    Session commits, the relays of this process waiting on the outbox wake (outbox.wakeup).
    """

    def __init__(self, tables: Tables = DEFAULT) -> None:
        self.tables = instance(tables, "Outbox.tables", Tables, "a Tables (Tables.define(...))")
        self._insert = insert(tables.outbox)
        self._lock = _key_lock(tables.outbox)
        self._key_locks = KeyLocks(tables.outbox)

    @overload
    def add(
        self,
        session: AsyncSession,
        destination: str,
        body: bytes,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Awaitable[str]: ...
    @overload
    def add(
        self,
        session: Session,
        destination: str,
        body: bytes,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> str: ...
    def add(
        self,
        session: Session | AsyncSession,
        destination: str,
        body: bytes,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> str | Awaitable[str]:
        """Insert one event; returns its event_id (awaitable with an AsyncSession)."""
        row = self._row(destination, body, key, headers)
        if isinstance(session, AsyncSession):
            return self._add_async(session, row)
        connection = session.connection()
        held = before_commit.queue(session)
        if held is not None:
            _require_pipeline_open(connection)
        dialects.require_transaction(connection, _ADD, driver=False)
        dialect = _dialect(session)
        if key is not None and dialect == "postgresql":
            if held is not None:  # a pipeline transaction: locked in order before COMMIT
                hold_back(held, session, self.tables.outbox, row)
                return str(row["event_id"])
            session.execute(self._lock, {"key": key})
        elif is_mysql(dialect):
            if key is not None:
                self._lock_bucket(session, key)
            wakeup.after_commit(session, self.tables.outbox.fullname)
        session.execute(self._insert, row)
        return str(row["event_id"])

    def _lock_bucket(self, session: Session, key: str) -> None:
        wanted = self._key_locks.params([key])
        self._key_locks.check(wanted, list(session.execute(self._key_locks.statement, wanted)))

    async def _add_async(self, session: AsyncSession, row: dict[str, Any]) -> str:
        connection = (await session.connection()).sync_connection
        assert connection is not None, "an AsyncConnection in a transaction has its connection"
        held = before_commit.queue(session)
        if held is not None:
            _require_pipeline_open(connection)
        dialects.require_transaction(connection, _ADD, driver=False)
        dialect = session.get_bind().dialect.name
        if row["key"] is not None and dialect == "postgresql":
            if held is not None:  # a pipeline transaction: locked in order before COMMIT
                hold_back(held, session.sync_session, self.tables.outbox, row)
                return str(row["event_id"])
            await session.execute(self._lock, {"key": row["key"]})
        elif is_mysql(dialect):
            if row["key"] is not None:
                wanted = self._key_locks.params([row["key"]])
                locked = list(await session.execute(self._key_locks.statement, wanted))
                self._key_locks.check(wanted, locked)
            wakeup.after_commit(session.sync_session, self.tables.outbox.fullname)
        await session.execute(self._insert, row)
        return str(row["event_id"])

    @staticmethod
    def _row(
        destination: str, body: bytes, key: str | None, headers: Mapping[str, str] | None
    ) -> dict[str, Any]:
        if not isinstance(destination, str) or not 0 < len(destination) <= ID_LENGTH:
            raise ConfigurationError(f"destination must be a str of 1 to {ID_LENGTH} characters")
        if key is not None and (not isinstance(key, str) or len(key) > ID_LENGTH):
            raise ConfigurationError(f"key must be None or a str of at most {ID_LENGTH} characters")
        if not isinstance(body, bytes | bytearray):
            raise ConfigurationError(f"body must be bytes, got {type(body).__name__}")
        merged = _checked_headers(headers)
        _encodable(destination, key, *merged, *merged.values())
        event_id = new_event_id()
        if hooks.outbox_headers is not None:  # telemetry: the current W3C trace context
            hooks.outbox_headers(merged)
        merged[ID_HEADER] = event_id
        now = utcnow()
        return {
            "event_id": event_id,
            "destination": destination,
            "key": key,
            "body": bytes(body),
            "headers": merged,
            "created_at": now,
            "available_at": now,
            "attempts": 0,
        }


def _checked_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    """A copy of ``headers``, refused unless every name and value is a str.

    Anything else has no single right text: None would arrive as "None", bytes
    as their repr, so the caller must say what it means.
    """
    if headers is None:
        return {}
    if not isinstance(headers, Mapping):
        raise ConfigurationError(
            f"headers must be a mapping of str to str, not {type(headers).__name__}"
        )
    for name, value in headers.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise ConfigurationError(
                f"header {name!r} must be str -> str, not "
                f"{type(name).__name__} -> {type(value).__name__}: convert it yourself"
            )
    return dict(headers)


def _encodable(*texts: str | None) -> None:
    """Refuse a lone surrogate at ``add``: no database or broker can carry it, and found
    later (at COMMIT, or by the relay) it fails the transaction or parks the event."""
    for value in texts:
        if value is None:
            continue
        try:
            value.encode()
        except UnicodeEncodeError:
            raise ConfigurationError(
                f"{_shown(value)} is not valid Unicode (a lone surrogate): an outbox "
                "destination, key or header must encode to UTF-8"
            ) from None


def _shown(value: str) -> str:
    return ascii(value[:40])


def _require_pipeline_open(connection: Connection) -> None:
    """In a pipeline transaction (its before-commit queue is open): TransactionBroken if the
    driver says the transaction is over. The pipeline verified at BEGIN that the connection
    is not in autocommit, and the guard refuses every commit a handler can make through
    SQLAlchemy; what is left is the raw DB-API connection's rollback() (or a commit through
    libpq itself). Nothing of the handler can commit then: the message fails alone."""
    if not dialects.in_driver_transaction(connection.connection.driver_connection):
        raise TransactionBroken(
            f"{_ADD}: the handler ended the pipeline's transaction through the raw DB-API "
            "connection (its rollback() or commit()), so this event could not commit with "
            "the dedup record and the handler's writes: never commit or roll back the raw "
            "connection (driver_connection(session)) in a handler; to undo part of the "
            "work, wrap it in session.begin_nested()"
        )


def _key_lock(table: Table) -> Any:
    key = func.hashtext(bindparam("key", type_=String()))
    return select(func.pg_advisory_xact_lock(locks.space(locks.PRODUCER, table), key))


def _dialect(session: Session) -> str:
    bind = session.get_bind()
    return bind.dialect.name
