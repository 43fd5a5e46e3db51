"""Transactional mode's guard: the endpoint must not end the request's transaction itself.

The claim row, the endpoint's writes and the stored response commit together
only if the middleware's commit is the one that happens. An endpoint that
commits would publish its writes and an in-flight claim with no response: a
crash then leaves the effect done and the key looking in flight. So a commit
inside the endpoint raises CommitInEndpoint (the request fails, everything
rolls back, nothing is stored), and so does transaction-control SQL on the
request's connection (``COMMIT``, ``END``, ``ROLLBACK``, ``BEGIN`` in any
spelling db.control_sql reads), which would commit or drop the claim behind
the session's back, and so does the request's Connection.commit(); a savepoint's
commit (``begin_nested()``) is not refused; ``allow()`` lifts the guard for the
middleware's own commit. Not refused: the raw DB-API connection's own ``commit()``, except that
on PostgreSQL's pipelined path (sql_pipeline.py, a connection in autocommit) any
statement after it, or after the raw ``rollback()``, is. Shared by the ASGI and
WSGI middleware.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, event
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from ..db.control_sql import transaction_control
from ..errors import ConsumerDedupError
from . import sql_pipeline

if TYPE_CHECKING:
    from .sql_store import SqlStore
    from .stored import StoredResponse


class CommitInEndpoint(ConsumerDedupError):
    """A transactional endpoint committed the request's session: refused, all rolled back."""


def hold_commits(session: Session | AsyncSession) -> Callable[[], None]:
    """Refuse every commit on ``session`` until the returned ``allow()`` is called."""
    target = session.sync_session if isinstance(session, AsyncSession) else session
    allowed = False

    def refuse(_: Any) -> None:
        # A savepoint's commit (begin_nested()'s RELEASE) keeps the claim's transaction.
        if not allowed and not target.in_nested_transaction():
            raise CommitInEndpoint(
                "a transactional idempotent endpoint called commit() on the request's session; "
                "leave the commit to the middleware (it commits your writes with the stored "
                "response), or make the route non-transactional"
            )

    pipelined = sql_pipeline.is_pipelined(target)

    def refuse_connection_commit(conn: Connection) -> None:
        # Connection.commit() (session.connection().commit()) skips the Session's
        # before_commit: raised here, before the driver's commit, nothing commits. SQLAlchemy
        # then counts the transaction as over while the database's is open, which the pool
        # cannot take back (in autocommit it fails to reset the connection and keeps it
        # checked out forever), so the connection is discarded: its transaction with it.
        if not allowed:
            conn.invalidate()
            raise CommitInEndpoint(
                "a transactional idempotent endpoint called commit() on the request's "
                "connection; leave the commit to the middleware (it commits your writes with "
                "the stored response), or make the route non-transactional"
            )

    def refuse_sql(conn: Connection, _cursor: Any, statement: str, *_args: Any) -> None:
        if pipelined and sql_pipeline.ended(conn):
            # The connection is in autocommit (sql_pipeline.py): with its transaction ended
            # behind the Session's back (the raw DB-API rollback()), this would commit alone;
            # so would the flush of the middleware's own commit (allowed or not).
            raise CommitInEndpoint(
                "a transactional idempotent endpoint ended the request's transaction itself "
                "(the DB-API connection's rollback() or commit()?); leave ending it to the "
                "middleware, or make the route non-transactional"
            )
        word = None if allowed else transaction_control(statement, conn.dialect.name)
        if word:
            raise CommitInEndpoint(
                f"a transactional idempotent endpoint sent {word} on the request's connection; "
                "leave ending the transaction to the middleware (it commits your writes with "
                "the stored response), or make the route non-transactional"
            )

    def allow() -> None:
        nonlocal allowed
        allowed = True

    event.listen(target, "before_commit", refuse)
    # The claim made the connection (claim_in), so this is the request's own; no I/O here.
    connection = target.connection()
    event.listen(connection, "before_cursor_execute", refuse_sql)
    event.listen(connection, "commit", refuse_connection_commit)
    return allow


def complete_and_commit(
    store: SqlStore,
    session: Session,
    allow: Callable[[], None],
    scope: str,
    key: str,
    token: str,
    response: StoredResponse,
    expiry: timedelta,
) -> None:
    """Store the response in the request's transaction, lift the guard, commit (blocking)."""
    store.complete_in(session, scope, key, response, expiry, token)
    allow()
    session.commit()
