"""After a handler call failed: did the transaction end, so that the claims may have committed?

Some ways of ending the transaction get past every guard (handler_guard: a COMMIT
through libpq itself, or a cursor class made by hand), and whatever they committed
(the attempt's claims, as PROCESSED) stays committed. Both drivers ask here when a
handler call failed, and only then, without a round trip: what the driver says of the
attempt's connection (driver_state). Ended means the claims must be undone before the
pipeline goes on (pipeline.py); anything else (still open, aborted, a lost connection,
which the server rolls back) leaves the failure as it was.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from ..errors import TransactionBroken
from .driver_state import idle
from .failures import HandlerEnded


def after_handler(session: Session, error: Exception) -> Exception:
    """``error``, or HandlerEnded(error) if the transaction may have been committed in the
    handler call that raised it; read only then, from the session and the driver.

    Ended: the session's transaction is gone (the handler rolled back or closed the
    session: what it sent before that is unknown, so fail closed), or the driver says no
    transaction is open on its live connection. Not ended: the driver says open or
    aborted; the connection was lost (invalidated, or psycopg's UNKNOWN: the server rolls
    back); SQLAlchemy rolled back itself after a failed flush, unless the guard's
    TransactionBroken is in ``error``'s chain (it saw the transaction end first).
    """
    transaction = session.get_transaction()
    if transaction is None:
        return HandlerEnded(error)
    if not transaction.is_active:  # a failed flush: SQLAlchemy's own rollback
        return HandlerEnded(error) if _broken(error) else error
    try:
        connection = session.connection()  # the transaction's own: no I/O
        if connection.closed:
            return HandlerEnded(error)
        if connection.invalidated or not idle(connection):
            return error
    except Exception:  # a state we cannot read: fail closed (undoing costs one DELETE)
        pass
    return HandlerEnded(error)


def _broken(error: BaseException) -> bool:
    """The guard's TransactionBroken is in ``error``'s chain (what was raised, caused or met
    while handling it): it saw the transaction end, whatever the handler raised then."""
    seen: set[int] = set()
    stack: list[object] = [error]
    while stack:
        current = stack.pop()
        if not isinstance(current, BaseException) or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, TransactionBroken):
            return True
        stack += [current.__cause__, current.__context__, getattr(current, "error", None)]
    return False
