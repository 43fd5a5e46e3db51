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
any authorizer the application set on that connection), and so is transaction-control
SQL sent through the raw connection (its ``execute()`` and cursors: raw_commit). Not
refused in advance: the raw ``rollback()`` (SQLAlchemy's own rollback goes through it),
and on psycopg a COMMIT sent through libpq itself (``pgconn.exec_``) or a cursor class
made by hand (``psycopg.Cursor(raw)``): caught at the handler's next statement or when
it returns. The claims such a commit committed are deleted before the pipeline goes on
(handler_end, pipeline); the handler's own writes it committed stay, and may apply again
on the retry. Not covered: a crash between that commit and the repair (the claims stay
PROCESSED), and a COMMIT followed by a BEGIN through libpq (the driver then reports a
transaction open, so nothing is seen).

What a call leaves behind is kept within it: a ``ROLLBACK TO`` a savepoint the call did
not open (a batch-mate's, left open) is refused before it is sent (call_savepoints); on
psycopg a cursor made in the call is refused once it is over and the raw ``rollback()``
from another thread or task while the guard is on (raw_commit), and a ``search_path``
a handler changed is swapped back for our records after it (search_path).

Where the guard sits: its listeners act only on what a handler is handed; they are
installed once, on the engine copy and the session factory's class (guard_listeners).
On psycopg every statement of the call is watched at the driver connection's cursors,
which are swapped for the call (raw_commit: the checks above, the error kept, the state
after it), so a statement costs no SQLAlchemy event dispatch. On SQLite SQLAlchemy's
cursor events do it; SQLAlchemy offers ``handle_error`` only for a whole dialect (every
connection of an engine), so the error a handler swallowed is taken from the statement's
own execution context instead (``ExecutionContext.handle_dbapi_exception``, set on that
one statement's context). The driver's transaction state is read locally (driver_state).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from sqlalchemy import Connection
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine.interfaces import ExecutionContext
from sqlalchemy.orm import Session, SessionTransaction
from sqlalchemy.util import await_only

from ..db import before_commit, mysql_errors
from ..db.control_sql import may_set_path, savepoint_steps, transaction_control
from ..errors import CommitInHandler, ConfigurationError, TransactionBroken
from ..reasons import describe
from .asyncpg_watch import is_asyncpg, probe, watch_asyncpg
from .call_savepoints import CallSavepoints
from .driver_state import ABORTED, ENDED, OPEN, driver_state, idle, idle_of, state_of
from .guard_listeners import CALL, statements_on_driver, watch_connection, watch_session
from .raw_commit import expire, refuse_raw_commit
from .search_path import PathKeeper, send_first_asyncpg

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
_UNWATCHED = (
    "the engine's dialect is psycopg's but its connections are not psycopg connections (a "
    "creator= wrapper): the handler's statements cannot be watched; give the engine the "
    "DB-API module its dialect loads itself"
)
_ATTEMPT = "consumerdedup.attempt_call"
"""In ``session.info``: the HandlerCall of the attempt running on that session."""


def attempt_call(session: Session) -> HandlerCall:
    """The guard of the handler calls of the attempt running on ``session`` (an
    AsyncSession's sync_session): made at its first call, reused for the next ones (the
    listeners' routes, the driver's swapped cursors and refused commit stay in place,
    which costs nothing per statement in between), until ``end_calls``."""
    call: HandlerCall | None = session.info.get(_ATTEMPT)
    if call is None:
        call = session.info[_ATTEMPT] = HandlerCall(session, session.connection())
    else:
        call.again()
    return call


def ours_next(session: Session) -> None:
    """The next statement on ``session``'s connection is a record of ours (search_path)."""
    call: HandlerCall | None = session.info.get(_ATTEMPT)
    if call is not None:
        call._path.ours = True


def end_calls(session: Session) -> str | None:
    """The attempt commits, rolls back or is over: lift its handler calls' guard. Sends back
    why the transaction ended under it since (None: it did not): before a COMMIT, a thread
    a handler left running may have rolled back on the raw connection after the last call,
    and SQLite then begins a new transaction by itself, which looks open."""
    call: HandlerCall | None = session.info.pop(_ATTEMPT, None)
    if call is None:
        return None
    call.lift()
    return call.ended


class HandlerCall:
    """Around an attempt's handler calls: refuse commits during them, check the transaction
    after each (``finish``, ``verify``).

    ``connection`` is the session's connection in this transaction (for an
    AsyncSession, its ``sync_connection``), taken before the first call. Their listeners
    route events to this call from here until ``lift``.
    """

    def __init__(self, session: Session, connection: Connection) -> None:
        self.session = session
        self.connection = connection
        self.transaction: SessionTransaction | None = session.get_transaction()
        # Our claim or lookup has run in this transaction: a driver that does not say it is
        # open now is one whose state we cannot read (a DB-API swapped in through module= or
        # creator=): refused, as every check below would be meaningless on it.
        self._fairy: Any = connection.connection
        self._raw: Any = self._fairy.driver_connection
        if state_of(self._raw) != OPEN:
            raise ConfigurationError(
                f"{connection.dialect.name}+{connection.dialect.driver}: the connection "
                f"({type(self._raw).__name__}) does not report "
                "the open transaction before the handler runs, so whether the handler's work "
                "can commit cannot be verified; give the engine the DB-API module its dialect "
                "loads itself (no module=, and no creator= returning a wrapper around the "
                "connection)"
            )
        self.ended: str | None = None
        """Why the transaction is over, once a listener saw it end."""
        self.ended_by_error = False
        """It ended with the error in ``swallowed`` (MySQL: a deadlock)."""
        self.swallowed: tuple[BaseException, str, Any, bool] | None = None
        """The last DB-API error of the handler's statements, with its statement."""
        self.statement: tuple[str, Any, bool] = ("", None, False)
        """The handler's last statement: its text, parameters and whether executemany."""
        self.second_connection = False
        self.savepoints = CallSavepoints()
        """The savepoints this call opened: it may roll back to those only."""
        self._owner = _caller()
        self._cursors: list[Any] = []
        self._path = PathKeeper()
        """The transaction's search_path, for our records whatever path a handler set."""
        """The cursors made since this call began (psycopg): refused once it is over."""
        """The pipeline's thread and task: the raw rollback() is refused from any other."""
        # The pooled connection's own dict: still reachable if the handler gave it back.
        self.info = connection.info
        self._asyncpg = is_asyncpg(self._raw)
        """asyncpg: its methods watched, and whether it was aborted asked (asyncpg_watch)."""
        self._aborted = False
        self._cursor_task: tuple[int, object] | None = None
        """The task in which SQLAlchemy's cursor runs a statement (asyncpg: its adapter's
        calls to asyncpg pass unchecked then, checked at SQLAlchemy's cursor events)."""
        self._permitted = False
        if self._asyncpg:
            self._unlock = watch_asyncpg(self._fairy.dbapi_connection, self._raw, self)
            on_driver = False
        else:
            self._unlock, on_driver = refuse_raw_commit(self._raw, self)
        self._lifted = False
        if on_driver or self._asyncpg:
            # Given back to the pool while the attempt runs (the handler's rollback() or
            # close()), the connection could go to another checkout still carrying this
            # call's guard, and the handler could go on sending on it: it is discarded.
            self._record = self._fairy._connection_record
            self._record.finalize_callback.append(self._given_back)
        if not on_driver:  # SQLite, asyncpg: SQLAlchemy's cursor events (psycopg: its cursors)
            if statements_on_driver(connection.engine):  # pragma: no cover - require_driver
                self._unlock()
                raise ConfigurationError(_UNWATCHED)
            watch_connection(connection)
        watch_session(session)
        session.info[CALL] = self.info[CALL] = self

    @property
    def driver(self) -> Any:
        """The driver's connection the calls run on (driver_connection.py)."""
        return self._raw

    def again(self) -> None:
        """Before the next handler call of the same attempt: the guard stayed in place since
        the last one returned, so whatever ran on the connection in between was watched
        too (a thread the last handler left running); the transaction must still be open."""
        if self.ended or state_of(self._raw) != OPEN:
            self.ended = self.ended or "the transaction ended between two handler calls"
            raise TransactionBroken(
                f"{self.ended} (a thread or callback of an earlier handler still using the "
                "session?): the pipeline must commit each handler's writes with its record"
            )
        self.swallowed = None
        self.statement = ("", None, False)
        self.savepoints = CallSavepoints()

    def finish(self) -> None:
        """Call after the handler, whether it returned or raised (in a ``finally``).

        A second connection is a setup fault, whatever the handler made of it:
        ConfigurationError, so that no message is recorded for it.
        """
        expire(self._cursors)
        before_commit.seen_through(self.session)
        if self.second_connection:
            raise ConfigurationError(_TWO_CONNECTIONS)

    def lift(self) -> None:
        """The attempt's handler calls are over: the session, the connection and the driver
        are left as they were (end_calls)."""
        self.session.info.pop(CALL, None)
        self.info.pop(CALL, None)
        expire(self._cursors)
        if not self._lifted:
            self._lifted = True
            self._unlock()

    def _given_back(self, _dbapi_connection: Any) -> None:
        """The pool takes the connection back (psycopg): after ``lift``, as it should be;
        before it, the handler gave it back, and it is invalidated (closed: whatever the
        handler sends on it next fails, and the pool opens a new one for the next checkout)."""
        if self._lifted:
            return
        self._lifted = True
        self.ended = self.ended or (
            "the handler gave the session's connection back to the pool (rollback or close)"
        )
        self._unlock()
        self._record.invalidate(TransactionBroken(self.ended))

    def verify(self) -> None:
        """Raise TransactionBroken if the handler returned with the transaction unusable."""
        if self.ended:
            # MySQL's deadlock: the error the handler swallowed decides (transient: retried).
            cause = self._swallowed_error() if self.ended_by_error else None
            raise TransactionBroken(f"{self.ended}: {_ADVICE}", cause)
        if self.session.get_transaction() is not self.transaction:
            raise TransactionBroken(
                "the handler ended the session's transaction (rollback or close): its writes "
                f"and the dedup record can no longer commit together; {_ADVICE}"
            )
        state = ABORTED if self._aborted else state_of(self._raw)
        if state == ABORTED or not self.session.is_active:
            cause = self._swallowed_error()
            caught = f" ({describe(cause)})" if cause is not None else ""
            raise TransactionBroken(
                f"the handler caught a database error and went on{caught}; the transaction "
                f"was aborted, so nothing of it can commit: {_ADVICE}",
                cause,
            )
        if state == ENDED or not self.connection.in_transaction():
            raise TransactionBroken(
                "the database transaction ended inside the handler: the pipeline must "
                "commit the handler's writes with the dedup record"
            )

    # Session listeners ------------------------------------------------------------------------

    def refuse_commit(self, session: Session) -> None:
        # A begin_nested() block's RELEASE fires before_commit too: that one is the handler's.
        if not session.in_nested_transaction():
            raise CommitInHandler(f"the handler called session.commit(): {_NO_COMMIT}")

    def refuse_second_connection(
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

    def before_statement(
        self,
        conn: Connection,
        _cursor: Any,
        statement: str,
        parameters: Any,
        context: ExecutionContext | None,
        executemany: bool,
    ) -> None:
        self._refuse_after_end()
        if idle(conn):
            self._ended_outside()
        self._refuse_control(statement, conn.dialect.name)
        self.statement = (statement, parameters, executemany)
        if context is not None and "handle_dbapi_exception" not in vars(context):
            # SQLAlchemy hands a failed statement's DB-API error to its context: this one's
            # (once: an insertmanyvalues context runs a statement per page).
            own = context.handle_dbapi_exception

            def failed(error: BaseException) -> None:
                own(error)
                self._on_error(conn, error)

            context.handle_dbapi_exception = failed  # type: ignore[method-assign,assignment]
        if self._asyncpg:
            self._keep_path(statement)
            self._cursor_task = _caller()

    def _keep_path(self, sql: str) -> None:
        """asyncpg, a statement through SQLAlchemy (in its greenlet): the search_path read
        or swapped first, as psycopg's watched cursors do (search_path)."""
        may_set = may_set_path(sql)
        if may_set:  # held-back outbox events may not follow it (fails closed there)
            before_commit.path_may_change(self.session, sql)
        first = self._path.before(may_set)
        if first is not None:
            self.sent_first(first, await_only(send_first_asyncpg(self._raw, first)))

    def _on_error(self, conn: Connection, error: BaseException) -> None:
        self._cursor_task = None
        self.swallowed = (error, *self.statement)
        number = mysql_errors.errno(error)
        if number in mysql_errors.ENDS_TRANSACTION:
            # InnoDB undid the whole transaction (a deadlock), claim included, and the next
            # statement would open a new one that passes for ours: this call is over. Other
            # errors (1062, 1406) undo their statement alone, as a savepoint would: a
            # handler that catches one goes on in our transaction (docs/databases.md).
            self.ended = f"the database rolled the whole transaction back (MySQL error {number})"
            self.ended_by_error = True
        elif not conn.invalidated and driver_state(conn) == ENDED:
            self.ended = "the database rolled the transaction back after an error"

    def after_statement(self, conn: Connection, *_args: Any) -> None:
        self._cursor_task = None
        # Whatever got past the text check: the driver says the transaction is over. Later
        # statements would run outside it (each committing at once), so stop at this one.
        if driver_state(conn) == ENDED:
            self._ended_by_statement()

    # Statements on asyncpg's connection itself (asyncpg_watch) ---------------------------------

    def in_cursor(self) -> bool:
        return self._cursor_task is not None and self._cursor_task == _caller()

    def permitted(self) -> bool:
        return self._permitted

    def permit(self, allowed: bool) -> None:
        self._permitted = allowed

    def before_raw(self, sql: str) -> Any:
        self._refuse_after_end()
        if idle_of(self._raw):
            self._ended_outside()
        self._refuse_control(sql, "postgresql")
        if savepoint_steps(sql, "postgresql"):
            before_commit.savepoint_below(self.session)  # what it holds back cannot follow
        may_set = may_set_path(sql)
        if may_set:  # held-back outbox events may not follow it (fails closed there)
            before_commit.path_may_change(self.session, sql)
        self.statement = (sql, None, False)
        return self._path.before(may_set)

    def discard(self) -> None:
        """asyncpg: a statement of the call was refused; its connection is invalidated (the
        pool closes it, the server rolls back), as SQLAlchemy does with a lost one."""
        if not (self.connection.closed or self.connection.invalidated):
            self.connection.invalidate()

    def failed_raw(self, error: BaseException) -> None:
        self.swallowed = (error, *self.statement)
        if not self._raw.is_closed() and state_of(self._raw) == ENDED:
            self.ended = "the database rolled the transaction back after an error"

    async def probe(self) -> None:
        """After the call, before ``verify`` (the async driver): on asyncpg, if the call met
        a database error and the transaction is still open, ask the server whether it was
        aborted (one statement; asyncpg cannot say). A call that met none costs nothing:
        an error nobody saw is caught by the COMMIT's statement (asyncpg_watch)."""
        if not self._asyncpg or self.ended:
            return
        if self._raw.is_closed():  # asyncpg drops the server's FATAL (25P03) unread
            self.ended = (
                "the connection was lost while the handler ran (the server's "
                "idle_in_transaction_session_timeout, or the network)"
            )
            # As SQLAlchemy does at a statement that meets a lost connection: the rollback
            # then sends nothing (the server rolled back), and the pool opens a new one.
            self.connection.invalidate()
            return
        if self.swallowed is None:
            return
        if self.session.is_active and state_of(self._raw) == OPEN:
            self._aborted = await probe(self._raw)

    # Statements at the psycopg connection's cursors (raw_commit) ------------------------------

    def before_sql(self, sql: str, parameters: Any, executemany: bool) -> Any:
        self._refuse_after_end()
        if idle_of(self._raw):
            self._ended_outside()
        self._refuse_control(sql, "postgresql")
        if savepoint_steps(sql, "postgresql") and not _sqlalchemys(sql):
            before_commit.savepoint_below(self.session)  # what it holds back cannot follow
        self.statement = (sql, parameters, executemany)
        may_set = may_set_path(sql)
        if may_set:  # held-back outbox events may not follow it (fails closed there)
            before_commit.path_may_change(self.session, sql)
        return self._path.before(may_set)

    def sent_first(self, first: Any, value: Any) -> None:
        if first[2]:
            self._path.read(first, value)

    def savepoint_below(self) -> None:
        before_commit.savepoint_below(self.session, unseen=True)

    def failed_sql(self, error: BaseException) -> None:
        self.swallowed = (error, *self.statement)
        raw = self._raw
        if not (raw.closed or raw.broken) and state_of(raw) == ENDED:
            self.ended = "the database rolled the transaction back after an error"

    def after_sql(self) -> None:
        if state_of(self._raw) == ENDED:
            self._ended_by_statement()

    # The checks both routes make ------------------------------------------------------------

    def _refuse_after_end(self) -> None:
        if self.ended:  # SQLite would run what follows outside any transaction, committing it
            raise TransactionBroken(
                f"{self.ended}; the handler went on with more statements: {_ADVICE}"
            )

    def _ended_outside(self) -> None:
        # Ended since the last statement we saw: by the raw DB-API connection's commit() or
        # rollback(). This statement would begin a new transaction that then passes for
        # ours. (A lost connection is not idle: its statement fails as it would, retried.)
        self.ended = "the transaction ended outside SQLAlchemy (the raw DB-API connection)"
        raise TransactionBroken(
            "the handler ended the transaction through the raw DB-API connection (its "
            f"commit() or rollback()), then sent another statement: {_NO_COMMIT}; never "
            "commit or roll back the raw connection in a handler (driver_connection(session) "
            "is for statements; to undo part of the work, use session.begin_nested())"
        )

    def _refuse_control(self, statement: str, dialect: str) -> None:
        word = transaction_control(statement, dialect)
        if word:
            self.ended = f"the handler sent {word}"
            if word in _COMMITS:
                raise CommitInHandler(f"the handler sent {word}: {_NO_COMMIT}")
            raise TransactionBroken(f"the handler sent {word}: the pipeline owns the transaction")
        refused = self.savepoints.follow(statement, dialect)
        if refused:  # before it is sent: the earlier message's writes stay
            self.ended = refused
            raise TransactionBroken(refused)

    def _ended_by_statement(self) -> None:
        self.ended = "a statement of the handler ended the transaction"
        raise TransactionBroken(
            "a statement of the handler ended the transaction: the pipeline must commit the "
            "handler's writes with the dedup record"
        )

    def on_commit(self, _conn: Connection) -> None:
        self.ended = "the handler committed the connection"
        raise CommitInHandler(f"the handler committed the connection: {_NO_COMMIT}")

    def made(self, cursor: Any) -> None:
        self._cursors.append(cursor)

    def refuse_foreign_rollback(self) -> None:
        caller = _caller()
        ours = caller == self._owner
        if not ours and not (caller[0] == self._owner[0] and _sqlalchemy_close(caller)):
            raise TransactionBroken(
                "the raw DB-API connection's rollback() was called from a thread or task "
                "other than the pipeline's while its transaction is open (one a handler left "
                "running?): refused; only the pipeline ends its transaction"
            )

    def ended_below(self, how: str) -> None:
        """SQLite's raw connection ended the transaction, or began a new one (raw_commit):
        whatever runs next runs outside the pipeline's transaction."""
        self.ended = self.ended or f"the transaction was ended inside the handler ({how})"

    def refuse_raw_end(self, word: str) -> CommitInHandler:
        """The raw DB-API connection's ``word``() was called (raw_commit): the error to raise."""
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


def _sqlalchemys(sql: str) -> bool:
    """Savepoint statements SQLAlchemy itself sends (``begin_nested``: its own names, which
    the outbox follows through SQLAlchemy's events); anything else reached the cursor from
    the raw connection, or as SQL text (refused by the outbox's own listener alike)."""
    return all(
        (name or "").startswith("sa_savepoint_")
        for _verb, name in savepoint_steps(sql, "postgresql")
    )


_SHIELDED_CLOSES = frozenset({"AsyncSession.close", "AsyncConnection.close"})
"""SQLAlchemy's asyncio close() runs its rollback in a task of its own (asyncio.shield):
refusing it left the connection in its transaction, holding the claim's row lock, and a
pipeline that wrote its FAILED record next waited on that lock for ever (round 5's shared
session). The COMMIT's verification still catches a transaction ended that way."""


def _sqlalchemy_close(caller: tuple[int, object]) -> bool:
    """The rollback comes from SQLAlchemy's shielded close() on the pipeline's thread."""
    task = caller[1]
    coro = task.get_coro() if isinstance(task, asyncio.Task) else None
    return getattr(coro, "__qualname__", "") in _SHIELDED_CLOSES


def _caller() -> tuple[int, object]:
    """This thread, and this asyncio task (None outside one)."""
    try:
        task: object = asyncio.current_task()
    except RuntimeError:  # no event loop in this thread
        task = None
    return threading.get_ident(), task


def pending_writes(session: Session) -> bool:
    """ORM changes a flush would write: the driver flushes after a handler only then (an
    AsyncSession's flush costs a greenlet switch even with nothing to write)."""
    return bool(session.new or session.deleted or session.dirty)
