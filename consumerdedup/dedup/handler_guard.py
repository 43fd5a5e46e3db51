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
reported with the error the handler swallowed. The raw DB-API connection's own
``commit()`` is refused while a handler runs too (psycopg and aiosqlite: the
method is replaced for the call; sqlite3: its authorizer denies COMMIT, replacing
any authorizer the application set on that connection). Not refused in advance:
its ``rollback()`` (SQLAlchemy's own rollback goes through it) and, on psycopg, a
COMMIT sent through the raw connection's ``execute()``: caught at the handler's
next statement or when it returns; what such a commit committed stays committed.

Where the guard sits: nowhere but on what a handler is handed. The first time a
session instance is handed to a handler, it gets SQLAlchemy event listeners
(``before_commit``, ``after_begin``), and so does the connection the session
really uses in the pipeline's transaction (``before_cursor_execute``,
``after_cursor_execute``, ``commit``), whatever engine the session was made
from. They act only while a HandlerCall runs on that object (it sets itself in
the session's and the connection's ``info`` and takes itself out when the call
ends) and go with the object: the pipeline's sessions and connections last one
attempt, so a batch pays ``event.listen`` once, not once a message. Nothing is
installed on the Session class, on an engine, or on any other session or
connection. SQLAlchemy offers
``handle_error`` only for a whole dialect (every connection of an engine), so
the error a handler swallowed is taken from the statement's own execution
context instead (``ExecutionContext.handle_dbapi_exception``, set on that one
statement's context).
"""

from __future__ import annotations

import inspect
import sqlite3
import weakref
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine.interfaces import ExecutionContext
from sqlalchemy.orm import Session, SessionTransaction

from ..db.control_sql import transaction_control
from ..errors import CommitInHandler, ConfigurationError, TransactionBroken
from ..reasons import describe

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


class HandlerCall:
    """Around one handler call: refuse commits during it, then check the transaction.

    ``connection`` is the session's connection in this transaction (for an
    AsyncSession, its ``sync_connection``), taken before the call. Their listeners
    route events to this call from here until ``finish``.
    """

    def __init__(self, session: Session, connection: Connection) -> None:
        self.session = session
        self.connection = connection
        self.transaction: SessionTransaction | None = session.get_transaction()
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
        self.ended: str | None = None
        """Why the transaction is over, once a listener saw it end."""
        self.swallowed: tuple[BaseException, str, Any, bool] | None = None
        """The last DB-API error of the handler's statements, with its statement."""
        self.statement: tuple[str, Any, bool] = ("", None, False)
        """The handler's last statement: its text, parameters and whether executemany."""
        self.second_connection = False
        _watch(session, _SESSION_EVENTS)
        _watch(connection, _CONNECTION_EVENTS)
        # The pooled connection's own dict: still reachable if the handler gave it back.
        self.info = connection.info
        session.info[_CALL] = self.info[_CALL] = self
        self._unlock = _lock_raw_ends(connection.connection.driver_connection, self)

    def finish(self) -> None:
        """Call after the handler, whether it returned or raised (in a ``finally``).

        A second connection is a setup fault, whatever the handler made of it:
        ConfigurationError, so that no message is recorded for it.
        """
        self.session.info.pop(_CALL, None)
        self.info.pop(_CALL, None)
        self._unlock()
        if self.second_connection:
            raise ConfigurationError(_TWO_CONNECTIONS)

    def verify(self) -> None:
        """Raise TransactionBroken if the handler returned with the transaction unusable."""
        if self.ended:
            raise TransactionBroken(f"{self.ended}: {_ADVICE}")
        if self.session.get_transaction() is not self.transaction:
            raise TransactionBroken(
                "the handler ended the session's transaction (rollback or close): its writes "
                f"and the dedup record can no longer commit together; {_ADVICE}"
            )
        state = _driver_state(self.connection)
        if state == "aborted" or not self.session.is_active:
            cause = self._swallowed_error()
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

    # Session listeners ------------------------------------------------------------------------

    def _refuse_commit(self, session: Session) -> None:
        # A begin_nested() block's RELEASE fires before_commit too: that one is the handler's.
        if not session.in_nested_transaction():
            raise CommitInHandler(f"the handler called session.commit(): {_NO_COMMIT}")

    def _refuse_second_connection(
        self, _session: Session, transaction: SessionTransaction, conn: Connection
    ) -> None:
        # The pipeline's connection began before the handler ran; any other one is a second.
        if conn is self.connection:  # a savepoint begins on the same connection
            return
        root = transaction
        while root.parent is not None:
            root = root.parent
        if root is self.transaction:
            self.second_connection = True
            raise TransactionBroken(_TWO_CONNECTIONS)
        # A new transaction after the handler's rollback() or close(): nothing of the handler's
        # may run in it, as it is not the pipeline's (its connection is unguarded, so its
        # commit would go through, again on every retry). The message's own failure.
        self.ended = "the handler ended the session's transaction (rollback or close)"
        raise TransactionBroken(
            f"{self.ended}, then went on in a new transaction: its writes there would commit "
            f"apart from the dedup record; {_ADVICE}"
        )

    # Connection listeners ---------------------------------------------------------------------

    def _before_statement(
        self,
        conn: Connection,
        _cursor: Any,
        statement: str,
        parameters: Any,
        context: ExecutionContext | None,
        executemany: bool,
    ) -> None:
        if self.ended:  # SQLite would run what follows outside any transaction, committing it
            raise TransactionBroken(
                f"{self.ended}; the handler went on with more statements: {_ADVICE}"
            )
        if _idle(conn):
            # Ended since the last statement we saw: by the raw DB-API connection's commit() or
            # rollback(). This statement would begin a new transaction that then passes for
            # ours. (A lost connection is not idle: its statement fails as it would, retried.)
            self.ended = "the transaction ended outside SQLAlchemy (the raw DB-API connection)"
            raise TransactionBroken(
                "the handler ended the transaction through the raw DB-API connection (its "
                f"commit() or rollback()), then sent another statement: {_NO_COMMIT}; never use "
                "the raw connection in a handler"
            )
        word = transaction_control(statement, conn.dialect.name)
        if word:
            self.ended = f"the handler sent {word}"
            if word in _COMMITS:
                raise CommitInHandler(f"the handler sent {word}: {_NO_COMMIT}")
            raise TransactionBroken(f"the handler sent {word}: the pipeline owns the transaction")
        self.statement = (statement, parameters, executemany)
        if context is not None and "handle_dbapi_exception" not in vars(context):
            # SQLAlchemy hands a failed statement's DB-API error to its context: this one's
            # (once: an insertmanyvalues context runs a statement per page).
            own = context.handle_dbapi_exception

            def failed(error: BaseException) -> None:
                own(error)
                self._on_error(conn, error)

            context.handle_dbapi_exception = failed  # type: ignore[method-assign,assignment]

    def _on_error(self, conn: Connection, error: BaseException) -> None:
        self.swallowed = (error, *self.statement)
        if not conn.invalidated and _driver_state(conn) == "ended":
            self.ended = "the database rolled the transaction back after an error"

    def _after_statement(self, conn: Connection, *_args: Any) -> None:
        # Whatever got past the text check: the driver says the transaction is over. Later
        # statements would run outside it (each committing at once), so stop at this one.
        if _driver_state(conn) == "ended":
            self.ended = "a statement of the handler ended the transaction"
            raise TransactionBroken(
                "a statement of the handler ended the transaction: the pipeline must commit the "
                "handler's writes with the dedup record"
            )

    def _on_commit(self, _conn: Connection) -> None:
        self.ended = "the handler committed the connection"
        raise CommitInHandler(f"the handler committed the connection: {_NO_COMMIT}")

    def _refuse_raw_end(self, word: str) -> CommitInHandler:
        self.ended = f"the handler called the raw DB-API connection's {word}()"
        return CommitInHandler(f"{self.ended}: {_NO_COMMIT}, and never through the raw connection")

    def _swallowed_error(self) -> BaseException | None:
        """The DB-API error last met, wrapped as SQLAlchemy raised it to the handler."""
        if self.swallowed is None:
            return None
        error, statement, parameters, executemany = self.swallowed
        dialect = self.connection.dialect
        return sa_exc.DBAPIError.instance(
            statement,
            parameters,
            error,
            dialect.loaded_dbapi.Error,
            hide_parameters=self.connection.engine.hide_parameters,
            connection_invalidated=self.connection.invalidated,
            dialect=dialect,
            ismulti=executemany,
        )


_CALL = "consumerdedup.handler_call"
"""In ``session.info`` and the connection's ``info``: the HandlerCall running on it."""
_watched: weakref.WeakSet[Session | Connection] = weakref.WeakSet()
"""Sessions and connections already handed to a handler: they carry our listeners."""


def _route(method: str) -> Callable[..., None]:
    """A listener that hands the event to the call running on the session or connection."""

    def listener(target: Any, *args: Any) -> None:
        call = target.info.get(_CALL)
        if call is not None:
            getattr(call, method)(target, *args)

    return listener


_SESSION_EVENTS = [
    ("before_commit", _route("_refuse_commit")),
    ("after_begin", _route("_refuse_second_connection")),
]
_CONNECTION_EVENTS = [
    ("before_cursor_execute", _route("_before_statement")),
    ("after_cursor_execute", _route("_after_statement")),
    ("commit", _route("_on_commit")),
]


def _watch(target: Session | Connection, events: list[tuple[str, Any]]) -> None:
    """Listen on ``target`` the first time it is handed to a handler. The first listeners on
    an object cost some 0.15-0.3 ms (measured, loaded 2-core box): paid once per attempt,
    so a batch pays it once and a message processed alone pays it whole."""
    if target not in _watched:
        for name, fn in events:
            event.listen(target, name, fn)
        _watched.add(target)


def _lock_raw_ends(raw: Any, call: HandlerCall) -> Callable[[], None]:
    """Refuse the raw DB-API connection's ``commit()`` while ``call`` runs (a rollback loses
    nothing, and SQLAlchemy's own rollback goes through it: caught afterwards, as before);
    send back what lifts that. Caught only afterwards, a raw commit would already have
    committed the batch's claims (claim-first: the messages after it reported DUPLICATE,
    their handlers never run) or its handlers' effects without their records (check-first:
    run again). sqlite3's methods cannot be replaced: its authorizer denies COMMIT
    instead (any authorizer of the application's on that connection is removed).
    A driver connection that takes neither is refused: the guard cannot hold on it."""
    if isinstance(raw, sqlite3.Connection):

        def authorize(action: int, *_args: Any) -> int:
            if action == sqlite3.SQLITE_TRANSACTION and str(_args[0]).upper() == "COMMIT":
                call._refuse_raw_end("commit")
                return sqlite3.SQLITE_DENY
            return sqlite3.SQLITE_OK

        raw.set_authorizer(authorize)
        return lambda: raw.set_authorizer(None)
    for word in ("commit",):
        try:
            setattr(
                raw, word, _refusal(call, word, inspect.iscoroutinefunction(getattr(raw, word)))
            )
        except (AttributeError, TypeError) as exc:
            raise ConfigurationError(
                f"{type(raw).__name__}: its {word}() cannot be refused while a handler runs, so "
                "a handler could commit apart from the dedup record; use the DB-API module "
                "its dialect loads itself"
            ) from exc

    def unlock() -> None:
        vars(raw).pop("commit", None)

    return unlock


def _refusal(call: HandlerCall, word: str, coroutine: bool) -> Callable[..., Any]:
    if coroutine:

        async def refuse_async(*_args: Any, **_kwargs: Any) -> None:
            raise call._refuse_raw_end(word)

        return refuse_async

    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise call._refuse_raw_end(word)

    return refuse


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
