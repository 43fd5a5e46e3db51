"""The error tree: one root, failures apart from control flow.

``PermanentError`` and its children end a message as FAILED (recorded and
dead-lettered); ``RetryLater`` asks for another delivery and records nothing.
"""

from __future__ import annotations


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


class SimulatedCrash(BaseException):
    """Raised by the test broker to kill a consumer between commit and ack.

    A BaseException so that handlers' and runners' ``except Exception`` blocks
    cannot swallow it, exactly as they could not swallow a real process death.
    """


def describe(error: BaseException) -> str:
    """``Type: text`` on one line, for logs, dead-letter headers and the error column."""
    text = " ".join(str(error).split())
    name = type(error).__name__
    return f"{name}: {text}" if text else name
