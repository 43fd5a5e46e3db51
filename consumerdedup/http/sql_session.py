"""Running the SQL store's statements: on a connection of its own, or in the request's Session.

``drive_sync``/``drive_async`` carry out KeyStatements.claim_steps on a connection;
``begin`` opens a real, write-locked transaction (BEGIN IMMEDIATE on SQLite) and
``begin_waiting`` bounds SQLite's wait for the write lock; ``claim_in`` and
``complete_in`` are transactional mode's claim and completion on a blocking Session
(AsyncSqlStore runs them in one run_sync). Shared by SqlStore and AsyncSqlStore.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from ..db import dialects, sqlite
from ..errors import ConsumerDedupError
from .sql_statements import KeyStatements, Step, lock_wait
from .store import ClaimResult
from .stored import StoredResponse

WHAT = "the idempotency-key store"


Steps = Generator[Step, Sequence[Any], ClaimResult]


def advance(steps: Steps, rows: Sequence[Any] | None) -> Step | ClaimResult:
    """The next (statement, params) to run, sent the last one's rows; at the end the result."""
    try:
        return steps.send(rows) if rows is not None else next(steps)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]


def drive_sync(conn: Connection, steps: Steps) -> ClaimResult:
    step = advance(steps, None)
    while isinstance(step, tuple):
        step = advance(steps, conn.execute(*step).all())
    return step


async def drive_async(conn: AsyncConnection | AsyncSession, steps: Steps) -> ClaimResult:
    step = advance(steps, None)
    while isinstance(step, tuple):
        step = advance(steps, (await conn.execute(*step)).all())
    return step


def begin(conn: Connection) -> None:
    """A real, write-locked transaction on a verified driver (BEGIN IMMEDIATE on SQLite)."""
    sqlite.begin_immediate(conn)
    dialects.require_transaction(conn, WHAT)


def begin_waiting(conn: Connection, wait: timedelta) -> None:
    """SQLite's twin of lock_timeout: BEGIN IMMEDIATE waits at most ``wait`` for the write
    lock (SQLITE_BUSY -> InFlight), not the connection's busy timeout, so twins blocked on
    one key cannot tie up every worker thread while the first request needs one to finish."""
    previous = conn.exec_driver_sql("PRAGMA busy_timeout").scalar_one()
    conn.exec_driver_sql(f"PRAGMA busy_timeout = {int(lock_wait(wait).removesuffix('ms'))}")
    try:
        begin(conn)
    finally:
        conn.exec_driver_sql(f"PRAGMA busy_timeout = {int(previous)}")


class ClaimLost(ConsumerDedupError):
    """Transactional mode: the request's transaction no longer holds its claim (the endpoint
    rolled the session back, which ended the transaction the claim lived in; a twin may have
    claimed the key since). Nothing may be stored or committed."""


def claim_in(
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
        begin_waiting(conn, wait)
    else:
        begin(conn)
    pg_wait = wait if conn.dialect.name == "postgresql" else None
    return drive_sync(conn, statements.claim_steps(scope, key, fingerprint, now, lease, pg_wait))


def complete_in(
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
