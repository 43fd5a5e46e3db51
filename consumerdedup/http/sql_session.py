"""Running the SQL store's statements: on a connection of its own, or in the request's Session.

``drive_sync``/``drive_async`` carry out KeyStatements.claim_steps on a connection;
``begin`` opens a real, write-locked transaction (BEGIN IMMEDIATE on SQLite) and
``begin_waiting`` bounds SQLite's wait for the write lock; ``claim_in`` and
``complete_in`` are transactional mode's claim and completion on a blocking Session
(AsyncSqlStore runs them in one run_sync). Shared by SqlStore and AsyncSqlStore.
"""

from __future__ import annotations

import json
from collections.abc import Generator, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import TextClause
from sqlalchemy.sql.selectable import TextualSelect

from ..db import dialects, sqlite
from ..errors import ConsumerDedupError
from . import sql_pipeline
from .sql_statements import IN_FLIGHT, KeyStatements, Step, lock_wait
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


_LOST = (
    f"{WHAT}: the request's transaction no longer holds its claim (did the endpoint "
    "call rollback() on the request's session? that ends the transaction the claim "
    "lived in, and a twin may have claimed the key since); nothing is committed"
)


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
    pipelined = sql_pipeline.take(session) if statements.dialect == "postgresql" else None
    conn = pipelined if pipelined is not None else session.connection()
    pg_wait = wait if conn.dialect.name == "postgresql" else None
    steps = statements.claim_steps(scope, key, fingerprint, now, lease, pg_wait)
    if pipelined is not None:
        first = advance(steps, None)
        assert isinstance(first, tuple)  # a claim has a statement
        if isinstance(first[0], TextClause | TextualSelect):  # sql_postgres.py's claims
            opening = sql_pipeline.begin_statement(session)
            rows = sql_pipeline.begin_with(conn, opening, first[0], first[1])  # BEGIN, the claim
        else:  # in autocommit: without our BEGIN the claim would commit alone
            conn.exec_driver_sql(sql_pipeline.begin_statement(session))
            rows = list(conn.execute(*first).all())
        begin(conn)  # verified: a real transaction on a supported driver
        step = advance(steps, rows)
        while isinstance(step, tuple):
            step = advance(steps, conn.execute(*step).all())
        return step
    if conn.dialect.name == "sqlite":
        begin_waiting(conn, wait)
    else:
        begin(conn)
    return drive_sync(conn, steps)


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
    guarded = statements.guarded_complete
    if token is not None and guarded is not None and sql_pipeline.is_pipelined(session):
        conn = sql_pipeline.held(session)
        if conn is None:  # the endpoint rolled the claim's transaction back
            raise ClaimLost(_LOST)
        # Stored at the commit, in its round trip: see sql_pipeline.commit_with.
        values = params | {"b_token": token, "b_in_flight": IN_FLIGHT}
        values["b_headers"] = json.dumps(params["b_headers"])
        sql_pipeline.commit_with(conn, guarded, values, ClaimLost)
        return
    statement = statements.complete_in
    if token is not None:  # the claim this transaction made, not one a twin made since
        statement, params = statements.complete, params | {"b_token": token}
    if session.execute(statement, params).rowcount != 1:  # type: ignore[attr-defined]
        raise ClaimLost(_LOST)
