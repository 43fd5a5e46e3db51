"""The driver's own connection of a handler's transaction.

SQLAlchemy reaches it from an AsyncSession with ``await (await
session.connection()).get_raw_connection()``: two greenlets made and switched to per
call, which for a per-message handler costs about as much as the statement it then sends
(bench/profile_kafka_chunks.py: 165 -> 110 us of CPU a message, psycopg, one INSERT). The
guard already holds that connection for the call (handler_guard.HandlerCall), so it is
handed over without an await. What the guard watches on it is what it watches through the
session: a COMMIT refused, every statement read (psycopg), the transaction read after the
call.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from ..errors import ConfigurationError
from ..options import refuse
from .guard_listeners import CALL


def driver_connection(session: Any) -> Any:
    """The DB-API driver's connection (psycopg's ``Connection`` or ``AsyncConnection``,
    asyncpg's, aiosqlite's, sqlite3's, PyMySQL's, aiomysql's) that the handler's
    ``session`` runs its transaction on, for a handler that sends its statements to the
    driver directly, without SQLAlchemy's cost per statement.

    Call it in a handler call, with the session the handler was given: what it sends
    there commits with the message's record, or not at all. Outside a handler call the
    session has no such transaction: ConfigurationError.
    """
    if not isinstance(session, Session | AsyncSession):
        raise refuse(
            "driver_connection(session)", session, "the Session or AsyncSession a handler was given"
        )
    call = session.info.get(CALL)
    if call is None:
        raise ConfigurationError(
            "driver_connection(session): no handler call is running on this session; call it "
            "inside a handler, with the session the handler was given (its transaction is the "
            "one the message's record commits in)"
        )
    return call.driver
