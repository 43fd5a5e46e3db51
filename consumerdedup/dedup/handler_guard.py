"""What a handler must not do to the pipeline's transaction, and how the drivers catch it.

A handler's writes commit with the dedup record only if the transaction is
still the pipeline's, and still alive, when the handler returns. Everyday
idioms break that silently: catching a database error and going on
(PostgreSQL aborts the transaction and answers the later COMMIT with ROLLBACK,
raising nothing; SQLite's ON CONFLICT ROLLBACK ends it, and later statements
then commit one by one), and ending the transaction (``session.commit()``,
``rollback()``, ``close()``, a COMMIT or ROLLBACK sent as SQL). Commits and
transaction-control SQL are refused while a handler runs, whatever its
spelling (db.control_sql); after every statement the driver's own transaction
state is read, so a statement that ended the transaction anyway is caught at
that statement; everything else is caught when the handler returns and
reported with the error the handler swallowed. The guard is installed on the
engine of the connection the handler really uses, whatever engine its
session was made from. Not refused in advance: the raw DB-API connection's
own ``commit()``/``rollback()`` (caught at the handler's next statement, or when it
returns; what such a commit committed stays committed).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, Engine, event
from sqlalchemy.engine import ExceptionContext
from sqlalchemy.engine.base import OptionEngine
from sqlalchemy.orm import Session, SessionTransaction

from ..db.control_sql import transaction_control
from ..errors import CommitInHandler, ConfigurationError, TransactionBroken
from ..reasons import describe

_HANDLER_RUNNING = "consumerdedup.handler_running"
_LAST_ERROR = "consumerdedup.last_error"
_ENDED = "consumerdedup.transaction_ended"
_GUARDED = "_consumerdedup_guarded"
_SECOND_CONNECTION = "consumerdedup.second_connection"
_PIPELINE_TRANSACTION = "consumerdedup.pipeline_transaction"
_TWO_CONNECTIONS = (
    "the handler's session began a transaction on a second connection (a session with "
    "several binds, or bind_arguments): writes there commit apart from the dedup record, "
    "so they can be kept when it rolls back; bind the handler's session to one engine"
)

_ADVICE = "wrap a statement that may fail in session.begin_nested(), so that only it is undone"
_NO_COMMIT = (
    "the pipeline commits the handler's writes together with the dedup record, so a "
    "handler must not commit"
)
_COMMITS = ("COMMIT", "END", "COMMIT PREPARED", "PREPARE TRANSACTION")


@event.listens_for(Session, "before_commit")
def _refuse_commit(session: Session) -> None:
    # A begin_nested() block's RELEASE fires before_commit too: that one is the handler's to make.
    if session.info.get(_HANDLER_RUNNING) is not None and not session.in_nested_transaction():
        raise CommitInHandler(f"the handler called session.commit(): {_NO_COMMIT}")


@event.listens_for(Session, "after_begin")
def _refuse_second_connection(
    session: Session, transaction: SessionTransaction, conn: Connection
) -> None:
    # The pipeline's connection began before the handler ran; any other one is a second.
    running = session.info.get(_HANDLER_RUNNING)
    if running is None or conn is running:  # a savepoint begins on the same connection
        return
    root = transaction
    while root.parent is not None:
        root = root.parent
    # A new transaction after the handler's rollback() is not a second connection of ours:
    # HandlerCall.verify reports that one (TransactionBroken, the message's own failure).
    if root is session.info.get(_PIPELINE_TRANSACTION):
        session.info[_SECOND_CONNECTION] = True
        raise TransactionBroken(_TWO_CONNECTIONS)


def guard(engine: Engine) -> None:
    """Watch the engine's connections while handlers run on them (once per engine).

    An engine made by ``execution_options()`` shares its parent's listeners: the
    root engine is the one guarded, so that no statement is checked twice.
    """
    while isinstance(engine, OptionEngine):
        engine = engine._proxied
    if getattr(engine, _GUARDED, False):
        return
    event.listen(engine, "handle_error", _on_error)
    event.listen(engine, "before_cursor_execute", _before_statement)
    event.listen(engine, "after_cursor_execute", _after_statement)
    event.listen(engine, "commit", _on_commit)
    setattr(engine, _GUARDED, True)


def _on_error(context: ExceptionContext) -> None:
    conn = context.connection
    if conn is None:
        return
    conn.info[_LAST_ERROR] = context.sqlalchemy_exception
    if conn.info.get(_HANDLER_RUNNING) and not conn.invalidated and _driver_state(conn) == "ended":
        conn.info[_ENDED] = "the database rolled the transaction back after an error"


def _before_statement(conn: Connection, _cursor: Any, statement: str, *_args: Any) -> None:
    if not conn.info.get(_HANDLER_RUNNING):
        return
    ended = conn.info.get(_ENDED)
    if ended:  # SQLite would run what follows outside any transaction, committing it at once
        raise TransactionBroken(f"{ended}; the handler went on with more statements: {_ADVICE}")
    if _idle(conn):
        # Ended since the last statement we saw: by the raw DB-API connection's commit() or
        # rollback(). This statement would begin a new transaction that then passes for ours.
        # (A lost connection is not idle: its statement fails as it would, and is retried.)
        conn.info[_ENDED] = "the transaction ended outside SQLAlchemy (the raw DB-API connection)"
        raise TransactionBroken(
            "the handler ended the transaction through the raw DB-API connection (its commit() "
            f"or rollback()), then sent another statement: {_NO_COMMIT}; never use the raw "
            "connection in a handler"
        )
    word = transaction_control(statement, conn.dialect.name)
    if word:
        conn.info[_ENDED] = f"the handler sent {word}"
        if word in _COMMITS:
            raise CommitInHandler(f"the handler sent {word}: {_NO_COMMIT}")
        raise TransactionBroken(f"the handler sent {word}: the pipeline owns the transaction")


def _after_statement(conn: Connection, *_args: Any) -> None:
    # Whatever got past the text check: the driver says the transaction is over. Later
    # statements would run outside it (each committing at once), so stop at this one.
    if conn.info.get(_HANDLER_RUNNING) and _driver_state(conn) == "ended":
        conn.info[_ENDED] = "a statement of the handler ended the transaction"
        raise TransactionBroken(
            "a statement of the handler ended the transaction: the pipeline must commit the "
            "handler's writes with the dedup record"
        )


def _on_commit(conn: Connection) -> None:
    if conn.info.get(_HANDLER_RUNNING):
        conn.info[_ENDED] = "the handler committed the connection"
        raise CommitInHandler(f"the handler committed the connection: {_NO_COMMIT}")


class HandlerCall:
    """Around one handler call: refuse commits during it, then check the transaction.

    ``connection`` is the session's connection in this transaction (for an
    AsyncSession, its ``sync_connection``), taken before the call.
    """

    def __init__(self, session: Session, connection: Connection) -> None:
        guard(connection.engine)  # the engine this session really uses, not only the one given
        self.session = session
        self.connection = connection
        self.transaction: SessionTransaction | None = session.get_transaction()
        # The pooled connection's own dict: still reachable if the handler gave it back.
        self.info = info = connection.info
        # Our claim or lookup has run in this transaction: a driver that does not say it is
        # open now is one whose state we cannot read (a DB-API swapped in through module= or
        # creator=): refused, as every check below would be meaningless on it.
        if _driver_state(connection) != "open":
            raise ConfigurationError(
                f"{connection.dialect.name}+{connection.dialect.driver}: the connection "
                f"({type(connection.connection.driver_connection).__name__}) does not report "
                "the open transaction before the handler runs, so whether the handler's work "
                "can commit cannot be verified; give the engine the DB-API module its dialect "
                "loads itself (no module=, and no creator= returning a wrapper around the "
                "connection)"
            )
        info.pop(_LAST_ERROR, None)
        info.pop(_ENDED, None)
        info[_HANDLER_RUNNING] = True
        session.info[_HANDLER_RUNNING] = connection
        session.info[_PIPELINE_TRANSACTION] = self.transaction

    def finish(self) -> None:
        """Call after the handler, whether it returned or raised (in a ``finally``).

        A second connection is a setup fault, whatever the handler made of it:
        ConfigurationError, so that no message is recorded for it.
        """
        self.session.info.pop(_HANDLER_RUNNING, None)
        self.session.info.pop(_PIPELINE_TRANSACTION, None)
        self.info.pop(_HANDLER_RUNNING, None)
        if self.session.info.pop(_SECOND_CONNECTION, None):
            raise ConfigurationError(_TWO_CONNECTIONS)

    def verify(self) -> None:
        """Raise TransactionBroken if the handler returned with the transaction unusable."""
        ended = self.info.pop(_ENDED, None)
        if ended:
            raise TransactionBroken(f"{ended}: {_ADVICE}")
        if self.session.get_transaction() is not self.transaction:
            raise TransactionBroken(
                "the handler ended the session's transaction (rollback or close): its writes "
                f"and the dedup record can no longer commit together; {_ADVICE}"
            )
        state = _driver_state(self.connection)
        if state == "aborted" or not self.session.is_active:
            cause = self.info.get(_LAST_ERROR)
            caught = f" ({describe(cause)})" if cause is not None else ""
            raise TransactionBroken(
                f"the handler caught a database error and went on{caught}; the transaction "
                f"was aborted, so nothing of it can commit: {_ADVICE}",
                cause,
            )
        if state == "ended" or not self.connection.in_transaction():
            raise TransactionBroken(
                "the database transaction ended inside the handler: the pipeline must "
                "commit the handler's writes with the dedup record"
            )


def _idle(connection: Connection) -> bool:
    """The driver says no transaction is open, on a healthy connection."""
    driver_connection = connection.connection.driver_connection
    status = getattr(getattr(driver_connection, "info", None), "transaction_status", None)
    if status is not None:
        return int(status) == 0  # psycopg's IDLE (UNKNOWN, 4, is a lost connection)
    return getattr(driver_connection, "in_transaction", None) is False


def _driver_state(connection: Connection) -> str:
    """``open``, ``aborted`` or ``ended``, from the driver without a round trip.

    Only drivers that tell are accepted (db.dialects.require_driver); should
    another reach here anyway, its silence reads as ``ended``, never as healthy.
    """
    driver_connection = connection.connection.driver_connection
    info = getattr(driver_connection, "info", None)
    status = getattr(info, "transaction_status", None)
    if status is not None:  # psycopg: IDLE 0, ACTIVE 1, INTRANS 2, INERROR 3, UNKNOWN 4
        return {2: "open", 1: "open", 3: "aborted"}.get(int(status), "ended")
    # sqlite3 and aiosqlite: False once SQLite rolled back on its own (ON CONFLICT ROLLBACK)
    return "open" if getattr(driver_connection, "in_transaction", None) is True else "ended"
