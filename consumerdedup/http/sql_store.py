"""The idempotency-key records in a SQL table (PostgreSQL, SQLite), blocking and asyncio.

A claim commits on its own with a lease (``claim``), or lives inside the
request's transaction (``claim_in``, transactional mode): see store.py for
the contract, sql_statements.py for the SQL (one set for both stores).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from ..db import dialects, sqlite
from ..errors import ConfigurationError, ConsumerDedupError
from ..schema import DEFAULT, Tables, utcnow
from .sql_statements import KeyStatements, Step, lock_wait
from .store import ClaimResult
from .stored import StoredResponse

Clock = Callable[[], datetime]
WHAT = "the idempotency-key store"


def _drive_sync(
    conn: Connection, steps: Generator[Step, Sequence[Any], ClaimResult]
) -> ClaimResult:
    rows: Sequence[Any] | None = None
    while True:
        try:
            statement, params = steps.send(rows) if rows is not None else next(steps)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        rows = conn.execute(statement, params).all()


async def _drive_async(
    conn: AsyncConnection | AsyncSession, steps: Generator[Step, Sequence[Any], ClaimResult]
) -> ClaimResult:
    rows: Sequence[Any] | None = None
    while True:
        try:
            statement, params = steps.send(rows) if rows is not None else next(steps)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        rows = (await conn.execute(statement, params)).all()


def _begin(conn: Connection) -> None:
    """A real, write-locked transaction on a verified driver (BEGIN IMMEDIATE on SQLite)."""
    sqlite.begin_immediate(conn)
    dialects.require_transaction(conn, WHAT)


def _begin_waiting(conn: Connection, wait: timedelta) -> None:
    """SQLite's twin of lock_timeout: BEGIN IMMEDIATE waits at most ``wait`` for the write
    lock (SQLITE_BUSY -> InFlight), not the connection's busy timeout, so twins blocked on
    one key cannot tie up every worker thread while the first request needs one to finish."""
    previous = conn.exec_driver_sql("PRAGMA busy_timeout").scalar_one()
    conn.exec_driver_sql(f"PRAGMA busy_timeout = {int(lock_wait(wait).removesuffix('ms'))}")
    try:
        _begin(conn)
    finally:
        conn.exec_driver_sql(f"PRAGMA busy_timeout = {int(previous)}")


class SqlStore:
    """IdempotencyStore and TransactionalStore over a blocking Engine."""

    def __init__(self, engine: Engine, tables: Tables = DEFAULT, *, clock: Clock = utcnow) -> None:
        if not isinstance(engine, Engine):
            raise ConfigurationError(f"{WHAT}: expected a SQLAlchemy Engine, not {engine!r}")
        dialects.require_transactional(engine, WHAT)
        self.engine = engine
        self.tables = tables
        self.clock = clock
        self.statements = KeyStatements(tables, engine.dialect.name)
        # PostgreSQL: every write of a claim committed apart is one atomic statement, so it
        # runs in autocommit (no BEGIN and COMMIT round trips); SQLite keeps BEGIN IMMEDIATE.
        self.alone = engine.dialect.name == "postgresql"
        self.autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")

    def claim(self, scope: str, key: str, fingerprint: str, lease: timedelta) -> ClaimResult:
        now = self.clock()
        if self.alone:
            with self.autocommit.connect() as conn:
                steps = self.statements.claim_steps(scope, key, fingerprint, now, lease, alone=True)
                return _drive_sync(conn, steps)
        with self.engine.connect() as conn, conn.begin():
            _begin(conn)
            return _drive_sync(
                conn, self.statements.claim_steps(scope, key, fingerprint, now, lease)
            )

    def renew(self, scope: str, key: str, token: str, lease: timedelta) -> bool:
        params: dict[str, Any] = {"b_scope": scope, "b_key": key, "b_token": token}
        params["b_locked_until"] = self.clock() + lease
        return self._write(self.statements.renew, params)

    def complete(
        self, scope: str, key: str, token: str, response: StoredResponse, expiry: timedelta
    ) -> bool:
        params = self.statements.finish_params(scope, key, response, self.clock() + expiry)
        return self._write(self.statements.complete, params | {"b_token": token})

    def release(self, scope: str, key: str, token: str) -> None:
        self._write(self.statements.release, {"b_scope": scope, "b_key": key, "b_token": token})

    def _write(self, statement: Any, params: dict[str, Any]) -> bool:
        if self.alone:
            with self.autocommit.connect() as conn:
                return bool(conn.execute(statement, params).rowcount == 1)
        with self.engine.connect() as conn, conn.begin():
            _begin(conn)
            return bool(conn.execute(statement, params).rowcount == 1)

    # Transactional mode: inside the request's Session, which the caller commits.
    def claim_in(
        self,
        session: Session,
        scope: str,
        key: str,
        fingerprint: str,
        wait: timedelta,
        lease: timedelta | None = None,
    ) -> ClaimResult:
        return _claim_in(
            self.statements, self.clock(), session, scope, key, fingerprint, wait, lease
        )

    def complete_in(
        self,
        session: Session,
        scope: str,
        key: str,
        response: StoredResponse,
        expiry: timedelta,
        token: str | None = None,
    ) -> None:
        _complete_in(self.statements, self.clock(), session, scope, key, response, expiry, token)


class ClaimLost(ConsumerDedupError):
    """Transactional mode: the request's transaction no longer holds its claim (the endpoint
    rolled the session back, which ended the transaction the claim lived in; a twin may have
    claimed the key since). Nothing may be stored or committed."""


def _claim_in(
    statements: KeyStatements,
    now: datetime,
    session: Session,
    scope: str,
    key: str,
    fingerprint: str,
    wait: timedelta,
    lease: timedelta | None,
) -> ClaimResult:
    """The transactional claim on a blocking Session (the async store runs it in one
    run_sync: the connection, the check and the statement in one greenlet switch)."""
    conn = session.connection()
    if conn.dialect.name == "sqlite":
        _begin_waiting(conn, wait)
    else:
        _begin(conn)
    pg_wait = wait if conn.dialect.name == "postgresql" else None
    return _drive_sync(conn, statements.claim_steps(scope, key, fingerprint, now, lease, pg_wait))


def _complete_in(
    statements: KeyStatements,
    now: datetime,
    session: Session,
    scope: str,
    key: str,
    response: StoredResponse,
    expiry: timedelta,
    token: str | None,
) -> None:
    params = statements.finish_params(scope, key, response, now + expiry)
    statement = statements.complete_in
    if token is not None:  # the claim this transaction made, not one a twin made since
        statement, params = statements.complete, params | {"b_token": token}
    if session.execute(statement, params).rowcount != 1:  # type: ignore[attr-defined]
        raise ClaimLost(
            f"{WHAT}: the request's transaction no longer holds its claim (did the endpoint "
            "call rollback() on the request's session? that ends the transaction the claim "
            "lived in, and a twin may have claimed the key since); nothing is committed"
        )


class AsyncSqlStore:
    """AsyncIdempotencyStore and AsyncTransactionalStore over an AsyncEngine."""

    def __init__(
        self, engine: AsyncEngine, tables: Tables = DEFAULT, *, clock: Clock = utcnow
    ) -> None:
        if not isinstance(engine, AsyncEngine):
            raise ConfigurationError(f"{WHAT}: expected a SQLAlchemy AsyncEngine, not {engine!r}")
        dialects.require_transactional(engine.sync_engine, WHAT)
        self.engine = engine
        self.tables = tables
        self.clock = clock
        self.statements = KeyStatements(tables, engine.dialect.name)
        self.alone = engine.dialect.name == "postgresql"  # as SqlStore
        self.autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")

    async def claim(self, scope: str, key: str, fingerprint: str, lease: timedelta) -> ClaimResult:
        now = self.clock()
        if self.alone:
            async with self.autocommit.connect() as conn:
                steps = self.statements.claim_steps(scope, key, fingerprint, now, lease, alone=True)
                return await _drive_async(conn, steps)
        async with self.engine.connect() as conn, conn.begin():
            await conn.run_sync(_begin)
            steps = self.statements.claim_steps(scope, key, fingerprint, now, lease)
            return await _drive_async(conn, steps)

    async def renew(self, scope: str, key: str, token: str, lease: timedelta) -> bool:
        params: dict[str, Any] = {"b_scope": scope, "b_key": key, "b_token": token}
        params["b_locked_until"] = self.clock() + lease
        return await self._write(self.statements.renew, params)

    async def complete(
        self, scope: str, key: str, token: str, response: StoredResponse, expiry: timedelta
    ) -> bool:
        params = self.statements.finish_params(scope, key, response, self.clock() + expiry)
        return await self._write(self.statements.complete, params | {"b_token": token})

    async def release(self, scope: str, key: str, token: str) -> None:
        await self._write(
            self.statements.release, {"b_scope": scope, "b_key": key, "b_token": token}
        )

    async def _write(self, statement: Any, params: dict[str, Any]) -> bool:
        if self.alone:
            async with self.autocommit.connect() as conn:
                return bool((await conn.execute(statement, params)).rowcount == 1)
        async with self.engine.connect() as conn, conn.begin():
            await conn.run_sync(_begin)
            return bool((await conn.execute(statement, params)).rowcount == 1)

    async def claim_in(
        self,
        session: AsyncSession,
        scope: str,
        key: str,
        fingerprint: str,
        wait: timedelta,
        lease: timedelta | None = None,
    ) -> ClaimResult:
        now = self.clock()
        args = (self.statements, now, scope, key, fingerprint, wait, lease)
        return await session.run_sync(lambda sync: _claim_in(args[0], now, sync, *args[2:]))

    async def complete_in(
        self,
        session: AsyncSession,
        scope: str,
        key: str,
        response: StoredResponse,
        expiry: timedelta,
        token: str | None = None,
        then: Callable[[Session], None] | None = None,
    ) -> None:
        """``then(sync_session)`` runs right after, in the same greenlet (the commit)."""
        now = self.clock()

        def complete(sync: Session) -> None:
            _complete_in(self.statements, now, sync, scope, key, response, expiry, token)
            if then is not None:
                then(sync)

        await session.run_sync(complete)
