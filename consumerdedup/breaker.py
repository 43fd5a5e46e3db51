"""The circuit breaker: a broken deploy stops its consumer instead of dead-lettering the stream.

A handler that fails on every message (it reads a field a deploy renamed) would
otherwise retry each message, end it FAILED and dead-letter it, one after
another, until the whole stream sits in the dead-letter queue. The breaker
counts the messages that end FAILED by their handler's error (a permanent
error, or an error that used up its attempts) in a row; when ``threshold`` of
them in a row failed with the same exception type, it opens:

* the pipeline tries no more messages: those of the batch in flight that were
  not tried end RETRY with ``CircuitOpen`` (not acked: the broker keeps them);
  the ones that failed keep their FAILED record and dead letter, as always;
* the runner stops taking messages and its ``run()`` ends with ``CircuitOpen``,
  logged at ERROR: an orchestrator restarts it (with its back-off), an operator
  sees it, ``runner.breaker.open`` says it to a readiness probe, and the
  ``consumerdedup.consumer.breaker.open`` metric to a dashboard.

After the fix: start the runner again (a new runner's breaker is closed), and
``consumerdedup failed replay`` brings back the messages that FAILED.

What counts: a PROCESSED message closes the run of failures; a failure of
another exception type starts a new one. A DUPLICATE, a RETRY (a transient
error: the database or the broker, which the breaker is not for) and a message
refused before its handler ran (no usable id, a known FAILED record, another
payload under its id) neither count nor close it. The threshold is
``RetryPolicy.breaker_threshold`` (10 by default; None turns the breaker off).
A runner's partitions share its breaker: thread-safe, and once open it stays
open (``reset()`` closes it).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import UTC, datetime

from .errors import CircuitOpen
from .observe import logger
from .options import integer, maybe
from .reasons import describe
from .telemetry import hooks


def error_type(error: BaseException) -> str:
    """The name the breaker compares failures by (and the metric's ``error.type``)."""
    kind = type(error)
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )


@dataclass(frozen=True)
class Trip:
    """Why the breaker opened: what a log line, a probe or an operator reads."""

    error_type: str
    failures: int
    """Messages in a row that failed with it."""
    message_id: str
    """The last of them."""
    reason: str
    """Its reason, as the dead letter carries it (``describe``: no data, no password)."""
    at: datetime


class CircuitBreaker:
    """Opens after ``threshold`` messages in a row failed for good with the same exception
    type (None: never). Read ``open`` and ``tripped``; the pipeline calls the rest."""

    def __init__(self, threshold: int | None, consumer: str = "") -> None:
        self.threshold = maybe(threshold, "breaker_threshold", integer, at_least=1)
        self.consumer = consumer
        self._lock = threading.Lock()
        self._kind: str | None = None
        self._failures = 0
        self._tripped: Trip | None = None

    @property
    def open(self) -> bool:
        """True once tripped (until ``reset()``): the runner takes no more messages."""
        return self._tripped is not None

    @property
    def tripped(self) -> Trip | None:
        """Why it opened, or None while closed."""
        return self._tripped

    @property
    def failures(self) -> int:
        """Messages in a row failed with the same exception type so far."""
        return self._failures

    def failed(self, message_id: str, error: BaseException) -> bool:
        """A message ended FAILED by its handler's ``error``; True if the breaker is open."""
        if self.threshold is None:
            return False
        kind = error_type(error)
        with self._lock:
            if self._tripped is not None:
                return True
            self._failures = self._failures + 1 if kind == self._kind else 1
            self._kind = kind
            if self._failures < self.threshold:
                return False
            trip = Trip(kind, self._failures, message_id, describe(error), datetime.now(UTC))
            self._tripped = trip
        logger.error(
            "consumer=%s circuit breaker open: %d messages in a row failed with %s (last "
            "message_id=%r: %s); taking no more messages, the rest stay with the broker. Fix "
            "the handler, start the consumer again, then `consumerdedup failed replay`",
            self.consumer,
            trip.failures,
            kind,
            message_id,
            trip.reason,
            extra={"consumer": self.consumer, "error_type": kind, "breaker": "open"},
        )
        if hooks.breaker is not None:
            hooks.breaker(self.consumer, kind, True)
        return True

    def succeeded(self) -> None:
        """A message was PROCESSED: the run of failures is over (an open breaker stays)."""
        if self._failures:
            with self._lock:
                self._failures, self._kind = 0, None

    def reset(self) -> None:
        """Close it again (a host that probes a fixed deploy, tests)."""
        with self._lock:
            trip, self._tripped = self._tripped, None
            self._failures, self._kind = 0, None
        if trip is not None and hooks.breaker is not None:
            hooks.breaker(self.consumer, trip.error_type, False)

    def error(self) -> CircuitOpen:
        """What an open breaker says: the RETRY reason of untried messages, run()'s error."""
        trip = self._tripped
        if trip is None:
            return CircuitOpen(f"consumer {self.consumer!r}: the circuit breaker is closed")
        return CircuitOpen(
            f"consumer {self.consumer!r} stopped by its circuit breaker: {trip.failures} "
            f"messages in a row failed with {trip.error_type} (last {trip.message_id!r:.80}: "
            f"{trip.reason:.300}); fix the handler, start the consumer again, then replay the "
            "FAILED ones (consumerdedup failed replay)"
        )

    def raise_if_open(self) -> None:
        """End a runner's ``run()`` with CircuitOpen if the breaker stopped it."""
        if self._tripped is not None:
            raise self.error()

    def __repr__(self) -> str:
        state = "open" if self.open else f"closed, {self._failures} in a row"
        return f"CircuitBreaker(threshold={self.threshold!r}, {state})"
