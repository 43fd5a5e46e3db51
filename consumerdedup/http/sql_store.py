"""The idempotency-key records in a SQL table (PostgreSQL, SQLite), blocking and asyncio.

A claim commits on its own with a lease (``claim``), or lives inside the
request's transaction (``claim_in``, transactional mode): see store.py for
the contract, sql_statements.py for the SQL (one set for both stores),
sql_session.py for running it on a connection or the request's Session.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from ..db import dialects
from ..options import function, instance, refuse
from ..schema import DEFAULT, Tables, utcnow
from . import sql_session
from .sql_session import WHAT, ClaimLost
from .sql_statements import KeyStatements
from .store import ClaimResult
from .stored import StoredResponse

Clock = Callable[[], datetime]


class SqlStore:
    """IdempotencyStore and TransactionalStore over a blocking Engine."""

    def __init__(self, engine: Engine, tables: Tables = DEFAULT, *, clock: Clock = utcnow) -> None:
        if not isinstance(engine, Engine):
            raise refuse("SqlStore.engine", engine, "a SQLAlchemy Engine (AsyncSqlStore takes "
                         "an AsyncEngine)")  # fmt: skip
        dialects.require_transactional(engine, WHAT)
        self.engine = engine
        self.tables = instance(tables, "SqlStore.tables", Tables, "a Tables (Tables.define(...))")
        self.clock: Clock = function(clock, "SqlStore.clock", "a callable() -> aware datetime")
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
                return sql_session.drive_sync(conn, steps)
        for attempt in sql_session.DEADLOCK_ATTEMPTS:
            try:
                with self.engine.connect() as conn, conn.begin():
                    sql_session.begin(conn)
                    return sql_session.drive_sync(
                        conn, self.statements.claim_steps(scope, key, fingerprint, now, lease)
                    )
            except Exception as error:  # the claim's own transaction: safe to run again
                sql_session.again_after(error, attempt)
        raise AssertionError("unreachable: the last attempt raises")

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
            sql_session.begin(conn)
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
        return sql_session.claim_in(
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
        sql_session.complete_in(
            self.statements, self.clock(), session, scope, key, response, expiry, token
        )


class AsyncSqlStore:
    """AsyncIdempotencyStore and AsyncTransactionalStore over an AsyncEngine."""

    def __init__(
        self, engine: AsyncEngine, tables: Tables = DEFAULT, *, clock: Clock = utcnow
    ) -> None:
        if not isinstance(engine, AsyncEngine):
            raise refuse("AsyncSqlStore.engine", engine, "a SQLAlchemy AsyncEngine (SqlStore "
                         "takes an Engine)")  # fmt: skip
        dialects.require_transactional(engine.sync_engine, WHAT)
        self.engine = engine
        where = "AsyncSqlStore."
        self.tables = instance(tables, where + "tables", Tables, "a Tables (Tables.define(...))")
        self.clock: Clock = function(clock, where + "clock", "a callable() -> aware datetime")
        self.statements = KeyStatements(tables, engine.dialect.name)
        self.alone = engine.dialect.name == "postgresql"  # as SqlStore
        self.autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")

    async def claim(self, scope: str, key: str, fingerprint: str, lease: timedelta) -> ClaimResult:
        now = self.clock()
        if self.alone:
            async with self.autocommit.connect() as conn:
                steps = self.statements.claim_steps(scope, key, fingerprint, now, lease, alone=True)
                return await sql_session.drive_async(conn, steps)
        for attempt in sql_session.DEADLOCK_ATTEMPTS:
            try:
                async with self.engine.connect() as conn, conn.begin():
                    await conn.run_sync(sql_session.begin)
                    steps = self.statements.claim_steps(scope, key, fingerprint, now, lease)
                    return await sql_session.drive_async(conn, steps)
            except Exception as error:  # the claim's own transaction: safe to run again
                sql_session.again_after(error, attempt)
        raise AssertionError("unreachable: the last attempt raises")

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
            await conn.run_sync(sql_session.begin)
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
        return await session.run_sync(
            lambda sync: sql_session.claim_in(args[0], now, sync, *args[2:])
        )

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
            sql_session.complete_in(self.statements, now, sync, scope, key, response, expiry, token)
            if then is not None:
                then(sync)

        await session.run_sync(complete)


__all__ = ["AsyncSqlStore", "ClaimLost", "SqlStore"]
