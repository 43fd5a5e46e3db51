"""Running the SQL store's statements: on a connection of its own, or in the request's Session.

``drive_sync``/``drive_async`` carry out KeyStatements.claim_steps on a connection;
``begin`` opens a real, write-locked transaction (BEGIN IMMEDIATE on SQLite) and
``begin_waiting`` bounds SQLite's wait for the write lock; ``claim_in`` and
``complete_in`` are transactional mode's claim and completion on a blocking Session
(AsyncSqlStore runs them in one run_sync). Shared by SqlStore and AsyncSqlStore.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import TextClause
from sqlalchemy.sql.selectable import TextualSelect

from ..db import dialects, mysql_errors, sqlite
from ..errors import ConsumerDedupError
from . import sql_pipeline
from .sql_statements import IN_FLIGHT, KeyStatements, Step, lock_wait, mysql_lock_wait
from .store import ClaimResult
from .stored import StoredResponse

WHAT = "the idempotency-key store"
DEADLOCK_ATTEMPTS = range(1, 6)
"""MySQL, MariaDB: a claim chosen as a deadlock's victim runs again, up to this many times.
Twins waiting on a claim whose transaction rolls back each hold a lock on the gap the row
left, and each one's insert waits on the others': InnoDB rolls all but one back (1213),
whole transactions. The claim is its transaction's first statement, so nothing else is
lost; run again, it waits on the twin that won and replays its response."""


Steps = Generator[Step, Sequence[Any], ClaimResult]


def advance(steps: Steps, rows: Sequence[Any] | None) -> Step | ClaimResult:
    """The next (statement, params) to run, sent the last one's rows; at the end the result."""
    try:
        return steps.send(rows) if rows is not None else next(steps)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]


def rows_of(result: Any) -> Sequence[Any]:
    """A step's rows; for a statement that returns none (MySQL has no RETURNING), one
    placeholder per row it matched, so "any rows" still means "it took the record"."""
    if result.returns_rows:
        return list(result.all())
    return [None] * max(int(result.rowcount), 0)


def again_after(error: Exception, attempt: int) -> None:
    """Return if ``error`` is a deadlock (1213) and attempts are left; else raise it."""
    if mysql_errors.errno(error) != mysql_errors.DEADLOCK or attempt >= DEADLOCK_ATTEMPTS[-1]:
        raise error


def drive_sync(conn: Connection, steps: Steps) -> ClaimResult:
    step = advance(steps, None)
    while isinstance(step, tuple):
        step = advance(steps, rows_of(conn.execute(*step)))
    return step


async def drive_async(conn: AsyncConnection | AsyncSession, steps: Steps) -> ClaimResult:
    step = advance(steps, None)
    while isinstance(step, tuple):
        step = advance(steps, rows_of(await conn.execute(*step)))
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
    fresh = not session.in_transaction()  # the claim opens the request's transaction
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
    if statements.mysql:

        def make_steps() -> Steps:
            return statements.claim_steps(scope, key, fingerprint, now, lease)

        return _claim_mysql(session, conn, make_steps, wait, fresh)
    return drive_sync(conn, steps)


def _claim_mysql(
    session: Session,
    conn: Connection,
    make_steps: Callable[[], Steps],
    wait: timedelta,
    fresh: bool,
) -> ClaimResult:
    """A deadlock victim's claim runs again (DEADLOCK_ATTEMPTS) when the claim opened its
    transaction (``fresh``): InnoDB rolled back the whole transaction, and anything the
    session wrote before the claim would be lost in silence, so then the error stays."""
    for attempt in DEADLOCK_ATTEMPTS:
        try:
            return _drive_waiting(conn, make_steps(), wait)
        except Exception as error:
            if not fresh:
                raise
            again_after(error, attempt)
        session.rollback()
        conn = session.connection()
        begin(conn)
    raise AssertionError("unreachable: the last attempt raises")


def _drive_waiting(conn: Connection, steps: Steps, wait: timedelta) -> ClaimResult:
    """MySQL, MariaDB: the claim waits on a twin's row lock at most ``wait`` (in whole
    seconds: innodb_lock_wait_timeout, set for the claim and restored after it, so the
    endpoint's own statements keep the session's). A timeout (1205) undoes the statement
    alone; the caller answers InFlight."""
    mariadb = bool(getattr(conn.dialect, "is_mariadb", False))
    previous = conn.exec_driver_sql("SELECT @@SESSION.innodb_lock_wait_timeout").scalar_one()
    seconds = mysql_lock_wait(wait, mariadb)
    conn.exec_driver_sql(f"SET SESSION innodb_lock_wait_timeout = {seconds}")
    try:
        return drive_sync(conn, steps)
    finally:
        conn.exec_driver_sql(f"SET SESSION innodb_lock_wait_timeout = {int(previous)}")


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
