"""One WARNING line per failed attempt, as it happens; a traceback once per distinct error.

The final Result has its own line (observe.log_result) when the batch ends; a
handler that fails on every message of a batch of 100 would otherwise say
nothing for minutes. Each line names the consumer, the message id, the attempt
(n of N), the exception type, its reason (``describe``: no bound parameter, no
password; at most SHORT_REASON characters) and what comes next. The scrubbed
traceback is added to the first line of each distinct error, by type and the
place it was raised, and not again: a deploy's one bug is one traceback, not
one per message and attempt. The errors seen are remembered per pipeline, the
most recent ``TRACEBACKS_SEEN``. The logger is ``consumerdedup.attempts``.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections import OrderedDict
from collections.abc import Sequence

from ..observe import mark_said, scrubbed_traceback
from ..reasons import describe

logger = logging.getLogger("consumerdedup.attempts")
"""A child of ``consumerdedup``: its level can be set apart (ERROR silences these lines)."""

TRACEBACKS_SEEN = 256
"""Distinct errors (type and place) remembered, so each traceback is logged once."""
SHORT_REASON = 300
"""Characters of the reason an attempt's line keeps (the final FAILED line has it all)."""

ErrorPlace = tuple[str, str, int]


def place(error: BaseException) -> ErrorPlace:
    """An error's type and where it was raised (the innermost frame of its traceback)."""
    kind = type(error)
    frames = traceback.extract_tb(error.__traceback__) if error.__traceback__ else []
    where = frames[-1] if frames else None
    name = f"{kind.__module__}.{kind.__qualname__}"
    return (name, where.filename, where.lineno or 0) if where else (name, "", 0)


def short(reason: str) -> str:
    """``reason`` cut to SHORT_REASON characters, saying so."""
    return reason if len(reason) <= SHORT_REASON else reason[: SHORT_REASON - 3] + "..."


class AttemptLog:
    """The failed attempts of one pipeline's messages, logged as they happen."""

    def __init__(self, consumer: str, attempts: int) -> None:
        self.consumer = consumer
        self.attempts = attempts
        self._seen: OrderedDict[ErrorPlace, None] = OrderedDict()
        self._lock = threading.Lock()  # a processor may run a handler in several threads

    def failed(self, keys: Sequence[str], attempt: int, error: BaseException, then: str) -> None:
        """``keys`` (one message, or a span that failed together) failed their ``attempt``-th
        try with ``error``; ``then`` says what follows (tried again, FAILED, RETRY)."""
        if not keys or not logger.isEnabledFor(logging.WARNING):
            return
        trace = "\n" + scrubbed_traceback(error) if self._first(error) else ""
        mark_said(error)
        which = (
            f"message_id={keys[0]!r}"
            if len(keys) == 1
            else f"{len(keys)} messages (message_id={keys[0]!r} first)"
        )
        logger.warning(
            "consumer=%s %s attempt %d/%d failed: error=%s reason=%s; %s%s",
            self.consumer,
            which,
            attempt,
            self.attempts,
            type(error).__qualname__,
            short(describe(error)),
            then,
            trace,
            extra={
                "consumer": self.consumer,
                "message_id": keys[0],
                "attempt": attempt,
                "error_type": type(error).__qualname__,
            },
        )

    def _first(self, error: BaseException) -> bool:
        """True the first time this error (type and place) is seen, as far as remembered."""
        key = place(error)
        with self._lock:
            if key in self._seen:
                self._seen.move_to_end(key)
                return False
            self._seen[key] = None
            while len(self._seen) > TRACEBACKS_SEEN:
                self._seen.popitem(last=False)
            return True
