"""What an operation's failure means: read once, where the driver throws it back in.

``carry(op)`` yields one operation to the driver. What comes back instead of a
value means one of three things, and nothing else in the pipeline reads errors:

- a setup fault (ConfigurationError, or a statement of ours the setup refused):
  raised on, out of the pipeline, to the caller; it is never a message's failure;
- the handler's failure (HandlerFailed): charged to its message; ``ended`` when the
  driver found the transaction over after the call (HandlerEnded): the handler may
  have committed the attempt's claims below the guard, and the pipeline undoes them;
- the transaction's failure (TransactionFailed): a statement of ours, the
  COMMIT or a ROLLBACK failed; nothing of the transaction stands.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from ..errors import ConfigurationError, PermanentError, RetryLater
from ..reasons import describe
from ..retry import outlasted, too_big
from .ops import CallBulk, CallHandler, Execute, HandlerRaised, Op
from .statements import Statements


class HandlerEnded(Exception):
    """Thrown in by a driver at CallHandler or CallBulk in place of ``error`` when, after
    the failed call, the transaction is over on a live connection (handler_end): what the
    handler sent below the guard (a COMMIT through libpq) may have committed the claims."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


class HandlerFailed(Exception):
    """The handler's call failed: its own code raised, or it broke the transaction.

    ``ended``: the driver found the transaction over after the call (HandlerEnded), so
    the attempt's claims may have been committed; ``setup``: ``error`` is a setup fault,
    raised on to the caller once those claims are undone.
    """

    def __init__(self, error: Exception, ended: bool = False, setup: bool = False) -> None:
        super().__init__(error)
        self.error = error
        self.ended = ended
        self.setup = setup


class TransactionFailed(Exception):
    """A statement of ours, the COMMIT or a ROLLBACK failed: the whole transaction is undone."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


class StatementRefused(Exception):
    """One of our statements failed for its size: with no SQLSTATE nor SQLite code on a live
    connection (the driver refused it: too many parameters, a value it cannot send), or the
    server ran out of lock memory or a program limit (retry.too_big). Halved, not
    retried as is; a lone item's failure is then classified by ``error`` as usual."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


class ClaimNotUndone(PermanentError):
    """The handler ended the transaction (its claims may have committed as PROCESSED), and
    deleting those claims failed too: the message is FAILED and dead-lettered, so that it
    is not lost behind a record that says it was processed (forget its key to replay it)."""


class RecordRefused(PermanentError):
    """Our record was refused as by a setup fault, in a transaction where a handler ran.

    A handler can cause that itself (``set_config('transaction_read_only', ...)``,
    ``SET ROLE``), so it is no setup fault yet: the span halves down to the culprit,
    whose FAILED record is then written with no handler in its transaction, where a
    real setup fault stops the caller.
    """


def carry(op: Op, *, after_handlers: bool = False) -> Generator[Op, Any, Any]:
    """Have the driver carry out ``op``; send back its value, or raise what its failure means."""
    try:
        return (yield op)
    except Exception as exc:
        meaning = _meaning(op, exc, after_handlers)
        if meaning is exc:
            raise
        raise meaning from exc


def _meaning(op: Op, exc: Exception, after_handlers: bool) -> Exception:
    if isinstance(exc, HandlerEnded):
        meaning = _meaning(op, exc.error, after_handlers)
        if isinstance(meaning, HandlerFailed):
            meaning.ended = True
            return meaning
        if isinstance(meaning, TransactionFailed):  # ended on a live connection: undo first
            return HandlerFailed(meaning.error, ended=True)
        return HandlerFailed(meaning, ended=True, setup=True)  # a setup fault, raised later
    if isinstance(op, CallHandler | CallBulk) and outlasted(exc):
        # The server ended the transaction for outlasting its bound: met at this call's
        # statement, but the idle time may be an earlier handler's. The span halves to
        # whoever it is, as for a failed COMMIT (a lone message is then charged).
        return TransactionFailed(exc.error if isinstance(exc, HandlerRaised) else exc)
    if isinstance(exc, HandlerRaised):  # the user's code, whatever it raised
        return HandlerFailed(exc.error)
    setup = exc if isinstance(exc, ConfigurationError) else None
    if setup is None and isinstance(op, Execute):
        setup = Statements.misconfigured(exc)
    if setup is not None and after_handlers:
        why = f"the dedup record could not be written after the handler ran ({describe(setup)})"
        refused = RecordRefused(why)
        refused.__cause__ = setup
        return TransactionFailed(refused)
    if setup is not None:
        return setup  # the driver's own check of the handler, or our statements' setup
    if isinstance(
        op, CallHandler | CallBulk
    ):  # the handler broke the transaction (TransactionBroken)
        return HandlerFailed(exc)
    if isinstance(op, Execute) and too_big(exc):
        return TransactionFailed(StatementRefused(exc))
    if isinstance(op, Execute) and _cancelled(exc):
        # Our claim waits on a twin's row lock until the holder ends: cancelled there
        # (statement_timeout), it is contention, not the message's failure (RETRY, as a
        # lock_timeout is); the holder decides the key.
        later = RetryLater(f"a statement of the pipeline's was cancelled: {describe(exc)}")
        later.__cause__ = exc
        return TransactionFailed(later)
    return TransactionFailed(exc)


def _cancelled(exc: Exception) -> bool:
    """PostgreSQL's query_canceled (57014): statement_timeout, or pg_cancel_backend."""
    return getattr(getattr(exc, "orig", None), "sqlstate", None) == "57014"


def signature(exc: BaseException) -> str:
    """Which failure this is, to tell one outage from another message's own failure: the
    exception's type, and the database's code (or the driver error's type) under it."""
    cause = getattr(exc, "cause", None) or exc  # TransactionBroken: what was swallowed
    orig = getattr(cause, "orig", None)
    code = getattr(orig, "sqlstate", None) or getattr(orig, "sqlite_errorname", None)
    name = type(cause).__qualname__
    return f"{name}/{code or type(orig).__qualname__}" if orig is not None else name
