"""What must hold before the pipeline's first statement in a session: a real transaction,
the session's own, on a supported driver; shared by both deduplicators."""

from __future__ import annotations

from sqlalchemy import Connection
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from ..db import dialects, sqlite
from ..errors import AuthenticationFailed, ConfigurationError
from ..reasons import authentication_refused, describe

_MAY_PASS = (
    sa_exc.DBAPIError,
    sa_exc.TimeoutError,
    sa_exc.DisconnectionError,
    OSError,
    ConfigurationError,
)
"""What beginning a transaction may raise for reasons that pass: the retry policy's to judge."""


def begin_checked(session: Session, what: str) -> None:
    """Before our first statement, on the connection the session really uses: a real
    transaction (BEGIN IMMEDIATE on SQLite), on a supported driver, not in autocommit,
    and the session's own (its commit is the database's)."""
    if session.twophase:  # PREPARE TRANSACTION at our COMMIT: a crash there holds the claims
        raise ConfigurationError(
            f"{what}: the session factory gives two-phase sessions (twophase=True); our "
            "commit must be a plain COMMIT (a prepared transaction left by a crash would hold "
            "its claims' locks until resolved by hand); use a session factory without twophase"
        )
    bind = session.get_bind()
    if isinstance(bind, Connection) and bind.in_transaction() and not session.in_transaction():
        raise ConfigurationError(
            f"{what}: the session factory gave a session bound to a Connection already in a "
            "transaction; the session would join it, and its commit would commit nothing "
            "(PROCESSED would be reported for work the caller may still roll back); give "
            "sessions bound to an engine, or to a connection not in a transaction"
        )
    try:
        connection = session.connection()
    except sa_exc.DBAPIError as exc:
        if authentication_refused(exc):  # retrying cannot fix a refused login: stop
            raise AuthenticationFailed(f"{what}: {describe(exc)}") from exc
        raise  # the database is unreachable, the pool is full: retried
    except _MAY_PASS:  # the database is unreachable, the pool is full: retried
        raise
    except Exception as exc:  # a creator=, a connect listener or a dialect that breaks
        raise ConfigurationError(
            f"{what}: the session factory's engine could not begin a transaction "
            f"({describe(exc)}): this is its setup, not any message's fault"
        ) from exc
    dialects.require_readable(connection, what)
    sqlite.begin_immediate(connection)
    dialects.require_transaction(connection, what)
