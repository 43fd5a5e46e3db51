"""Which errors are worth another attempt, and how long to wait before it."""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass
from datetime import timedelta

import sqlalchemy.exc
import tenacity

from .db import mysql_errors
from .errors import ConfigurationError, PermanentError, RetryLater, TransactionBroken
from .options import boolean, duration, integer, kinds, maybe, settle

# SQLSTATE classes that mean "the same statement can succeed if tried again":
# connection exceptions, serialization failure, deadlock, the server shutting
# down or starting up or out of connections, and a refused login or database
# (a setup problem no message is to blame for: held, not dead-lettered).
_TRANSIENT_SQLSTATES = (
    "08",
    "28",
    "3D000",
    "40001",
    "40P01",
    "57P01",
    "57P02",
    "57P03",
    "53",
    "55P03",
)
"""Class 53 is the server's resources (disk full 53100, out of shared memory 53200: a
partitioned claim of a huge batch can exhaust the lock table for every session, too many
connections 53300) and 55P03 a lock not obtained within lock_timeout or NOWAIT: contention
or the environment, never the message's own fault."""


# SQLite result codes that pass, or that no message is to blame for: a lock held by
# another writer, the file or the disk (missing, full, read-only).
_TRANSIENT_SQLITE = (
    "SQLITE_BUSY",
    "SQLITE_LOCKED",
    "SQLITE_IOERR",
    "SQLITE_PROTOCOL",
    "SQLITE_CANTOPEN",
    "SQLITE_FULL",
    "SQLITE_NOMEM",
    "SQLITE_READONLY",
)


_OUTLASTED_SQLSTATES = ("25P03", "25P04")
"""idle_in_transaction_session_timeout and transaction_timeout: the server ended the
connection because this transaction outlasted a bound (a handler idle too long, a batch
too long in all). A lost connection, but no outage: what the transaction did caused it,
so it is charged like a message's own error (UNKNOWN: tried again, then FAILED), which
also lets a batch halve to find the message that caused it instead of retrying the whole
batch as one for ever."""

SETUP_SQLSTATES = ("42P01", "42703", "42501", "3F000", "25006")
"""Undefined table, undefined column, insufficient privilege, no such schema, read-only:
the deploy's fault, not the data's. Met by our own statements they stop the caller
(ConfigurationError); met by a handler they are transient, never a message's permanent
failure: once the migration lands or the rights are granted, the redelivery succeeds."""

_SETUP_SQLITE = ("no such table", "no such column", "has no column named")
"""SQLite's words for 42P01 and 42703 (its code is only the generic SQLITE_ERROR)."""
_SETUP_SQLITE_CODES = ("SQLITE_READONLY",)
"""25006 on SQLite: a file opened read-only (mode=ro, file permissions). Only the bare code:
SQLITE_READONLY_RECOVERY and the other extended codes pass or are the file's state."""


def setup_fault(error: BaseException) -> bool:
    """The database refused a statement because of its setup: see SETUP_SQLSTATES."""
    orig = getattr(error, "orig", None) or error
    if getattr(orig, "sqlstate", None) in SETUP_SQLSTATES:
        return True
    if mysql_errors.errno(orig) in mysql_errors.SETUP:
        return True
    if getattr(orig, "sqlite_errorname", None) in _SETUP_SQLITE_CODES:
        return True
    return getattr(orig, "sqlite_errorname", None) == "SQLITE_ERROR" and any(
        words in str(orig) for words in _SETUP_SQLITE
    )


def uncoded(error: BaseException) -> bool:
    """A driver error with no SQLSTATE nor SQLite code, on a connection still alive: the
    driver refused the statement itself (psycopg: "number of parameters must be between 0
    and 65535"), so the same statement fails the same way again. Not a failure to connect
    (no statement yet): that is the database's absence, transient."""
    if not isinstance(error, sqlalchemy.exc.DBAPIError) or error.connection_invalidated:
        return False
    if error.statement is None:
        return False
    orig = error.orig
    if mysql_errors.errno(orig) is not None:  # MySQL's number is its code
        return False
    return not getattr(orig, "sqlstate", None) and not getattr(orig, "sqlite_errorname", None)


_TOO_BIG_SQLSTATES = ("53200", "54")
"""Out of shared memory (the partitioned claim's advisory locks filled the lock table:
max_locks_per_transaction) and the program limits (a statement too complex): a smaller
statement can pass where the same one fails every time."""


def too_big(error: BaseException) -> bool:
    """One of our statements failed for its size: see ``uncoded`` and _TOO_BIG_SQLSTATES."""
    state = getattr(getattr(error, "orig", None), "sqlstate", None)
    return uncoded(error) or bool(state and state.startswith(_TOO_BIG_SQLSTATES))


class ErrorKind(enum.Enum):
    PERMANENT = "permanent"
    TRANSIENT = "transient"
    UNKNOWN = "unknown"
    """Transient until the attempts run out, then permanent: a poison message must end."""


@dataclass(frozen=True)
class Backoff:
    """Exponential waits: ``first``, doubled per failure in a row, at most ``longest``; with
    ``jitter``, plus a random share of ``first`` on top, so that clients that failed together
    do not all come back together.

    ``delay(n)`` is the wait after ``n`` failures in a row, for the loops that count their
    own (the pipeline, the relay, the pruner, the runners); the Backoff is also a tenacity
    wait (``tenacity.Retrying(wait=backoff)``) for the loops tenacity runs.
    """

    first: timedelta
    longest: timedelta
    jitter: bool = True

    def __post_init__(self) -> None:
        settle(self, "first", duration(self.first, "Backoff.first", zero=True))
        longest = duration(self.longest, "Backoff.longest", at_least=self.first)
        settle(self, "longest", longest)
        settle(self, "jitter", boolean(self.jitter, "Backoff.jitter"))

    def __call__(self, state: tenacity.RetryCallState) -> float:
        return self.delay(state.attempt_number)

    def delay(self, failures: int) -> float:
        """Seconds to wait after ``failures`` failures in a row (1: the first wait)."""
        first, longest = self.first.total_seconds(), self.longest.total_seconds()
        doublings = min(max(failures, 1) - 1, _MAX_DOUBLINGS)
        wait = min(first * 2.0**doublings, longest)
        return wait + random.random() * first if self.jitter else wait


_MAX_DOUBLINGS = 64
"""Past this many, any first wait above 0 has reached any longest: no float overflows."""


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded in-process retries with exponential backoff and jitter (tenacity).

    ``attempts`` counts every try of a message, the first included; a message's
    n-th failed try is followed by ``initial_delay * 2**(n-1)`` (at most
    ``max_delay``, plus jitter) before its next one. ``transient`` and
    ``permanent`` extend the built-in classification with the caller's own
    exception types. ``breaker_threshold``: under a runner, after this many
    messages in a row FAILED with the same exception type, the runner stops
    taking messages (consumerdedup.breaker; None: never).
    """

    attempts: int = 4
    initial_delay: timedelta = timedelta(milliseconds=50)
    max_delay: timedelta = timedelta(seconds=2)
    transient: tuple[type[BaseException], ...] = ()
    permanent: tuple[type[BaseException], ...] = ()
    breaker_threshold: int | None = 10

    def __post_init__(self) -> None:
        maybe(self.breaker_threshold, "RetryPolicy.breaker_threshold", integer, at_least=1)
        _check_retry_policy(self)

    def backoff(self) -> Backoff:
        """The wait before each attempt after the first."""
        return Backoff(self.initial_delay, self.max_delay)

    def classify(self, exc: BaseException) -> ErrorKind:
        # The library's named errors keep their meaning whatever the extensions say.
        if isinstance(exc, PermanentError | RetryLater | ConfigurationError):
            return classify(exc)
        if isinstance(exc, TransactionBroken) and exc.cause is not None:
            return self.classify(exc.cause)  # what the handler swallowed decides
        if isinstance(exc, self.permanent):
            return ErrorKind.PERMANENT
        if isinstance(exc, self.transient):
            return ErrorKind.TRANSIENT
        return classify(exc)


def _check_retry_policy(policy: RetryPolicy) -> None:
    """RetryPolicy's own options (a function of its own: its __post_init__ is shared)."""
    settle(policy, "attempts", integer(policy.attempts, "RetryPolicy.attempts", at_least=1))
    first = duration(policy.initial_delay, "RetryPolicy.initial_delay", zero=True)
    settle(policy, "initial_delay", first)
    longest = duration(policy.max_delay, "RetryPolicy.max_delay", at_least=first)
    settle(policy, "max_delay", longest)
    settle(policy, "transient", kinds(policy.transient, "RetryPolicy.transient"))
    settle(policy, "permanent", kinds(policy.permanent, "RetryPolicy.permanent"))


def classify(exc: BaseException) -> ErrorKind:
    """The built-in rules: named errors first, then what the database driver says.

    A ConfigurationError that reaches here was raised by a handler (a bad argument
    to ``Outbox.add``): the same message fails the same way every time. One that our
    own statements or the driver meet never gets here: it stops the caller.
    """
    if isinstance(exc, PermanentError | ConfigurationError):
        return ErrorKind.PERMANENT
    if isinstance(exc, RetryLater | TimeoutError | ConnectionError):
        return ErrorKind.TRANSIENT
    if isinstance(exc, sqlalchemy.exc.DBAPIError):
        return _driver_kind(exc)
    if isinstance(exc, sqlalchemy.exc.DisconnectionError | sqlalchemy.exc.TimeoutError):
        return ErrorKind.TRANSIENT
    return _by_cause(exc)


def _by_cause(exc: BaseException) -> ErrorKind:
    """An error of the handler's own type that wraps a database error (``raise
    StorageError(...) from exc``, or raised inside its ``except``): a transient or setup
    fault under it decides, or one bad deploy would dead-letter every message whose handler
    wraps its errors. Anything else stays UNKNOWN."""
    seen = {id(exc)}
    link = _under(exc)
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, sqlalchemy.exc.DBAPIError) and (
            _driver_kind(link) is ErrorKind.TRANSIENT
        ):
            return ErrorKind.TRANSIENT
        link = _under(link)
    return ErrorKind.UNKNOWN


def outlasted(exc: BaseException) -> bool:
    """The server ended the transaction for outlasting its bound (25P03, 25P04), as
    ``exc`` says or a database error under it (a handler's own wrapper, a swallowed error
    the guard names). It surfaces at the next statement, whoever sends it: it names the
    transaction, not the message whose statement met it."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        orig = getattr(link, "orig", None)
        if getattr(orig, "sqlstate", None) in _OUTLASTED_SQLSTATES:
            return True
        link = getattr(link, "cause", None) or _under(link)
    return False


def _under(exc: BaseException) -> BaseException | None:
    return exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)


def _driver_kind(exc: sqlalchemy.exc.DBAPIError) -> ErrorKind:
    """By the database's own error code where it gives one, not by the DB-API class:
    psycopg calls "index row too large" an OperationalError, and so does sqlite3 for
    malformed JSON; retrying those forever would stall a stream."""
    sqlstate = getattr(exc.orig, "sqlstate", None)
    if sqlstate in _OUTLASTED_SQLSTATES:  # before connection_invalidated: the server's doing
        return ErrorKind.UNKNOWN
    if exc.connection_invalidated or setup_fault(exc):
        return ErrorKind.TRANSIENT
    number = mysql_errors.errno(exc)
    if number is not None:  # MySQL's SQLSTATEs are too coarse: its error number decides
        return ErrorKind.TRANSIENT if number in mysql_errors.TRANSIENT else ErrorKind.UNKNOWN
    if sqlstate:
        transient = sqlstate.startswith(_TRANSIENT_SQLSTATES)
        return ErrorKind.TRANSIENT if transient else ErrorKind.UNKNOWN
    sqlite_name = getattr(exc.orig, "sqlite_errorname", None)
    if sqlite_name:
        transient = sqlite_name.startswith(_TRANSIENT_SQLITE)
        return ErrorKind.TRANSIENT if transient else ErrorKind.UNKNOWN
    # No code: the driver failed to connect (a bad option, an unreachable host), which no
    # message is to blame for; a message's own error comes with a code.
    if exc.statement is None or isinstance(exc, sqlalchemy.exc.OperationalError):
        return ErrorKind.TRANSIENT
    return ErrorKind.UNKNOWN
