"""What a handler must not do to the pipeline's transaction, and how the drivers catch it.

A handler's writes commit with the dedup record only if the transaction is
still the pipeline's, and still alive, when the handler returns. Two everyday
idioms break that silently: catching a database error and going on (PostgreSQL
aborts the transaction and answers the later COMMIT with ROLLBACK, raising
nothing), and ending the transaction (``session.commit()``, ``rollback()``,
``close()``). The first is caught after the call and reported with the error
the handler swallowed; a commit is refused inside the call, before it happens.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, Engine, event
from sqlalchemy.engine import ExceptionContext
from sqlalchemy.orm import Session, SessionTransaction

from .errors import CommitInHandler, TransactionBroken, describe

_HANDLER_RUNNING = "consumerdedup.handler_running"
_LAST_ERROR = "consumerdedup.last_error"
_WATCHED = "_consumerdedup_errors_watched"

_ADVICE = "wrap a statement that may fail in session.begin_nested(), so that only it is undone"


@event.listens_for(Session, "before_commit")
def _refuse_commit(session: Session) -> None:
    # A begin_nested() block's RELEASE fires before_commit too: that one is the handler's to make.
    if session.info.get(_HANDLER_RUNNING) and not session.in_nested_transaction():
        raise CommitInHandler(
            "the handler called session.commit(): the pipeline commits the handler's "
            "writes together with the dedup record, so a handler must not commit"
        )


def watch_errors(engine: Engine) -> None:
    """Remember each connection's last database error, to name what a handler swallowed."""
    if getattr(engine, _WATCHED, False):
        return
    event.listen(engine, "handle_error", _remember)
    setattr(engine, _WATCHED, True)


def _remember(context: ExceptionContext) -> None:
    if context.connection is not None:
        context.connection.info[_LAST_ERROR] = context.sqlalchemy_exception


class HandlerCall:
    """Around one handler call: refuse commits during it, then check the transaction.

    ``connection`` is the session's connection in this transaction (for an
    AsyncSession, its ``sync_connection``), taken before the call.
    """

    def __init__(self, session: Session, connection: Connection) -> None:
        self.session = session
        self.connection = connection
        self.transaction: SessionTransaction | None = session.get_transaction()
        connection.info.pop(_LAST_ERROR, None)
        session.info[_HANDLER_RUNNING] = True

    def finish(self) -> None:
        """Call after the handler, whether it returned or raised."""
        self.session.info.pop(_HANDLER_RUNNING, None)

    def verify(self) -> None:
        """Raise TransactionBroken if the handler returned with the transaction unusable."""
        if self.session.get_transaction() is not self.transaction:
            raise TransactionBroken(
                "the handler ended the session's transaction (rollback or close): its writes "
                f"and the dedup record can no longer commit together; {_ADVICE}"
            )
        state = _driver_state(self.connection.connection.driver_connection)
        if state == "aborted" or not self.session.is_active:
            cause = self.connection.info.get(_LAST_ERROR)
            caught = f" ({describe(cause)})" if cause is not None else ""
            raise TransactionBroken(
                f"the handler caught a database error and went on{caught}; the transaction "
                f"was aborted, so nothing of it can commit: {_ADVICE}",
                cause,
            )
        if state == "ended":
            raise TransactionBroken(
                "the database transaction ended inside the handler (a COMMIT or ROLLBACK "
                "sent on the connection): the pipeline must commit the handler's writes "
                "with the dedup record"
            )


def _driver_state(driver_connection: Any) -> str:
    """``open``, ``aborted`` or ``ended``, from the driver without a round trip."""
    info = getattr(driver_connection, "info", None)
    status = getattr(info, "transaction_status", None)
    if status is not None:  # psycopg: IDLE 0, ACTIVE 1, INTRANS 2, INERROR 3, UNKNOWN 4
        return {2: "open", 1: "open", 3: "aborted"}.get(int(status), "ended")
    in_transaction = getattr(driver_connection, "in_transaction", None)
    if in_transaction is False:  # sqlite3 and aiosqlite: SQLite rolled back on its own
        return "ended"
    return "open"
