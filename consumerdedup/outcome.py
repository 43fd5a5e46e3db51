"""What became of one message."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .message import Message
from .reasons import describe


class Outcome(enum.Enum):
    """The four ends of the pipeline, and what the runner does with each."""

    PROCESSED = "processed"
    """The handler's writes and the dedup record committed together: ack."""
    DUPLICATE = "duplicate"
    """Seen and committed before (or by a concurrent twin): ack, handler not called."""
    FAILED = "failed"
    """Permanent failure: recorded, dead-lettered, then acked."""
    RETRY = "retry"
    """Transient failure after the in-process attempts: nothing recorded, do not ack."""

    @property
    def acks(self) -> bool:
        """Whether the broker delivery should be acknowledged."""
        return self is not Outcome.RETRY


@dataclass(frozen=True, slots=True)
class Result:
    """One message's outcome with the why, as runners and observers see it."""

    message: Message
    outcome: Outcome
    error: BaseException | None = None
    attempts: int = 1

    @property
    def reason(self) -> str | None:
        """A one-line reason for FAILED and RETRY outcomes, for logs and dead letters."""
        return None if self.error is None else describe(self.error)
