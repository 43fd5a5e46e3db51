"""The pipeline's COMMIT on psycopg, verified by the server's answer.

Right before COMMIT the driver says the transaction is open (transaction_start:
``require_open``), but something the pipeline cannot see may still end it in between:
a thread the handler left running that calls the raw connection's ``rollback()``. Then
psycopg's own ``commit()`` finds no transaction and sends nothing, and every message of
the transaction would be reported PROCESSED with neither its effects nor its record.

So, for the pipeline's COMMIT only, the driver connection's ``commit()`` is replaced
on the instance by one that sends ``COMMIT`` itself and reads what the server answers:
the warning ``there is no transaction in progress`` (SQLSTATE 25P01) means nothing was
committed, and a ``ROLLBACK`` tag means the transaction was aborted. Either raises
TransactionBroken: the attempt fails, nothing is reported done. The same round trip as
psycopg's (one COMMIT); SQLAlchemy's commit (its events, its state) runs as before.

Only while the driver is in autocommit (the pipelined BEGIN, db/pipelined_begin.py): there
a COMMIT reaches the server whatever the connection's state. On the plain path psycopg
would open a transaction first and commit that; it keeps psycopg's own commit.

On PyMySQL the COMMIT is the driver's own (a deadlock's lost claim is caught before it,
statements.holds), but the ROLLBACK the pool sends when the session hands the connection
back right after it is skipped when it cannot undo anything: the server's answer to our
COMMIT said no transaction is open, and nothing was sent since (any statement or BEGIN on
the connection in between puts the ROLLBACK back). psycopg skips that ROLLBACK itself on
an idle connection; PyMySQL sends it, one round trip a transaction for nothing.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from sqlalchemy.orm import Session

from ..db.dialects import SERVER_STATUS_IN_TRANS
from ..errors import TransactionBroken
from . import asyncpg_watch

try:
    import psycopg
except ImportError:  # pragma: no cover - PostgreSQL is an extra
    psycopg = None  # type: ignore[assignment]

_NO_TRANSACTION = "25P01"
_NOTHING = (
    "the pipeline's COMMIT found no transaction: it was rolled back before the COMMIT "
    "reached the server (a thread or task of a handler still using the raw connection?): "
    "nothing of it committed, nothing is reported done"
)
_ABORTED = (
    "the pipeline's COMMIT was answered ROLLBACK: the transaction was aborted before it "
    "(a statement sent by a thread or task of a handler failed?): nothing of it committed"
)


@contextlib.contextmanager
def verified_commit(session: Session) -> Iterator[None]:
    """Around ``session.commit()`` (an AsyncSession's ``sync_session``): the psycopg
    connection's commit() checks the server's answer (nothing else is touched). On asyncpg
    the COMMIT goes out with the statement that verifies it (asyncpg_watch)."""
    if session.in_transaction():
        driver = session.connection().connection.driver_connection  # the transaction's: no I/O
        if asyncpg_watch.is_asyncpg(driver):
            with asyncpg_watch.verified_commit(driver):
                yield
            return
    raw = _autocommit_psycopg(session)
    if raw is None:
        with _idle_reset_skipped(session):
            yield
        return
    own = vars(raw)
    before = own.get("commit")
    asynchronous = isinstance(raw, psycopg.AsyncConnection)
    own["commit"] = functools.partial(_commit_async if asynchronous else _commit, raw)
    try:
        yield
    finally:
        if before is None:
            own.pop("commit", None)
        else:
            own["commit"] = before


_MYSQL_METHODS = ("commit", "rollback", "query", "begin")


@contextlib.contextmanager
def _idle_reset_skipped(session: Session) -> Iterator[None]:
    """PyMySQL (see the module's doc): within the pipeline's ``session.commit()``, the
    pool's ROLLBACK right after a COMMIT the server answered with no transaction open is
    skipped, unless anything went out in between. Methods replaced on the instance for the
    call, as for psycopg's commit."""
    raw = _pymysql(session)
    if raw is None:
        yield
        return
    own = vars(raw)
    if any(name in own for name in _MYSQL_METHODS):  # replaced by someone else: leave it
        yield
        return
    cls = type(raw)

    def disarm() -> None:
        for name in ("rollback", "query", "begin"):
            own.pop(name, None)

    def rollback() -> None:  # the pool's reset: nothing to undo, nothing sent
        disarm()

    def query(sql: Any, unbuffered: bool = False) -> Any:
        disarm()
        return cls.query(raw, sql, unbuffered)

    def begin() -> None:
        disarm()
        cls.begin(raw)

    def commit() -> None:
        own.pop("commit", None)
        cls.commit(raw)  # raises on an error: nothing armed
        if not raw.server_status & SERVER_STATUS_IN_TRANS:
            own.update(rollback=rollback, query=query, begin=begin)

    own["commit"] = commit
    try:
        yield
    finally:
        for name in _MYSQL_METHODS:
            own.pop(name, None)


def _pymysql(session: Session) -> Any:
    if not session.in_transaction():
        return None
    raw = session.connection().connection.driver_connection  # the transaction's: no I/O
    if type(raw).__module__ != "pymysql.connections":
        return None
    status = getattr(raw, "server_status", None)
    return raw if isinstance(status, int) else None


def _autocommit_psycopg(session: Session) -> Any:
    if psycopg is None or not session.in_transaction():
        return None
    raw = session.connection().connection.driver_connection  # the transaction's: no I/O
    if isinstance(raw, psycopg.BaseConnection) and raw.autocommit:
        return raw
    return None


def _commit(raw: Any) -> None:
    heard: list[str | None] = []
    listen = functools.partial(_hear, heard)
    raw.add_notice_handler(listen)
    cursor = psycopg.Cursor(raw)  # never the guard's cursor class, whatever the factory
    try:
        cursor.execute(b"COMMIT")
        status = cursor.statusmessage
    finally:
        raw.remove_notice_handler(listen)
        cursor.close()
    _judge(status, heard)


async def _commit_async(raw: Any) -> None:
    heard: list[str | None] = []
    listen = functools.partial(_hear, heard)
    raw.add_notice_handler(listen)
    cursor = psycopg.AsyncCursor(raw)
    try:
        await cursor.execute(b"COMMIT")
        status = cursor.statusmessage
    finally:
        raw.remove_notice_handler(listen)
        await cursor.close()
    _judge(status, heard)


def _hear(heard: list[str | None], diagnostic: Any) -> None:
    heard.append(diagnostic.sqlstate)


def _judge(status: str | None, heard: list[str | None]) -> None:
    if _NO_TRANSACTION in heard:
        raise TransactionBroken(_NOTHING)
    if status != "COMMIT":
        raise TransactionBroken(_ABORTED)
