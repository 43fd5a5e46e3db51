"""The error tree: one root, failures apart from control flow.

``PermanentError`` and its children end a message as FAILED (recorded and
dead-lettered); ``RetryLater`` asks for another delivery and records nothing.
"""

from __future__ import annotations

import re

import sqlalchemy.exc


class ConsumerDedupError(Exception):
    """Root of every error this library raises on purpose."""


class ConfigurationError(ConsumerDedupError, ValueError):
    """A setting is invalid: caught at construction, before any message flows."""


class PermanentError(ConsumerDedupError):
    """The message can never succeed: record it as FAILED and dead-letter it.

    Raise it (or a subclass) from a handler to refuse a message for good.
    """

    @property
    def reason(self) -> str:
        return str(self) or type(self).__name__


class InvalidMessage(PermanentError):
    """The message itself is unusable: no valid id, or a malformed delivery."""


class DecodeError(PermanentError):
    """The body cannot be decoded into what the handler expects."""


class PayloadMismatch(PermanentError):
    """The id was processed before with a different payload: a reused id, never dropped silently."""

    def __init__(self, message_id: str, recorded_hash: str, received_hash: str) -> None:
        super().__init__(
            f"message id {message_id!r} was processed before with a different payload "
            f"(recorded sha256 {recorded_hash[:12]}..., received {received_hash[:12]}...)"
        )
        self.message_id = message_id
        self.recorded_hash = recorded_hash
        self.received_hash = received_hash


class RecordedFailure(PermanentError):
    """A redelivery of a message that FAILED before: dead-lettered again with the first reason."""


class RetryLater(ConsumerDedupError):
    """Control flow, not a failure: roll back and deliver the message again later."""


class TransactionBroken(ConsumerDedupError):
    """The handler left the pipeline's transaction unusable, so its writes cannot commit.

    It caught a database error and went on (PostgreSQL then answers COMMIT with
    ROLLBACK, silently), or it ended the transaction itself. ``cause`` is the
    swallowed error when it is known; the retry policy classifies by it.
    """

    def __init__(self, text: str, cause: BaseException | None = None) -> None:
        super().__init__(text)
        self.cause = cause


class CommitInHandler(PermanentError):
    """A handler called ``session.commit()``: refused, or its writes would commit
    without their dedup record."""


class HeldBack(RetryLater):
    """On an ordered source: not tried, because a message ahead of it will be delivered again."""


class BrokerUnavailable(ConsumerDedupError, ConnectionError):
    """The broker cannot be reached or did not answer in time: transient, charged to no event.

    Each adapter raises its own subclass; the outbox relay ends its round and backs off.
    """


class DestinationMissing(ConsumerDedupError):
    """The broker answered: this destination does not exist (and it does not create it).

    Not a BrokerUnavailable even when the client library calls it retriable:
    one event's topic must not stop the events of every other key.
    """


class SimulatedCrash(BaseException):
    """Raised by the test broker to kill a consumer between commit and ack.

    A BaseException so that handlers' and runners' ``except Exception`` blocks
    cannot swallow it, exactly as they could not swallow a real process death.
    """


REASON_LIMIT = 1000
"""Longest reason kept: it travels in log lines, the error column and broker headers."""

_QUOTED = re.compile(r'".*"', re.DOTALL)
"""From the first double quote to the last: a quoted value may itself hold quotes."""
_QUOTED_NAME = re.compile(r'"[^"]*"')
"""Integrity errors (SQLSTATE class 23) quote only names; their values are in DETAIL."""
_NUMBER = re.compile(r"\d{4,}")
_DIAG_NAMES = ("schema_name", "table_name", "column_name", "constraint_name")


def describe(error: BaseException) -> str:
    """``Type: text`` on one line, for logs, dead-letter headers and the error column.

    Never the statement's bound parameters, nor what a database quotes back
    (values in DETAIL lines, in quotes, long numbers): a reason is logged and
    sent to other systems. The text is storable (no NUL, no lone surrogate)
    and at most REASON_LIMIT long. It never raises.
    """
    try:
        text = _text(error)
    except Exception:  # a str() that raises must not take the pipeline with it
        text = "(its message could not be read)"
    text = " ".join(text.split())
    text = text.replace("\x00", "\\0").encode("utf-8", "backslashreplace").decode("utf-8")
    name = type(error).__name__
    line = f"{name}: {text}" if text else name
    return line if len(line) <= REASON_LIMIT else line[: REASON_LIMIT - 3] + "..."


def _text(error: BaseException) -> str:
    # SQLAlchemy's str() appends "[SQL: ...] [parameters: ...]": the driver's own error only.
    if isinstance(error, sqlalchemy.exc.StatementError):
        if error.orig is not None:
            return _driver_text(error.orig)
        return str(error.args[0]) if error.args else ""
    if _is_driver_error(error):
        return _driver_text(error)
    return str(error)


def _is_driver_error(error: BaseException) -> bool:
    return hasattr(error, "sqlstate") or hasattr(error, "sqlite_errorname")


def _driver_text(error: BaseException) -> str:
    """A DB-API error's primary message with what it quotes masked; the names of the
    schema, table, column and constraint (PostgreSQL reports them apart) kept."""
    diag = getattr(error, "diag", None)
    text = getattr(diag, "message_primary", None) or str(error)
    state = getattr(error, "sqlstate", None)
    quoted = _QUOTED_NAME if (state or "").startswith("23") else _QUOTED
    text = _NUMBER.sub("...", quoted.sub('"..."', text))
    facts = [f"{n.removesuffix('_name')} {v}" for n in _DIAG_NAMES if (v := getattr(diag, n, None))]
    if state:
        facts.insert(0, f"SQLSTATE {state}")
    return f"{text} ({'; '.join(facts)})" if facts else text
