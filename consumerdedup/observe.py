"""Outcome counters and log lines: what a consumer did, readable without a debugger.

One line per final Result on the ``consumerdedup`` logger: PROCESSED at DEBUG,
DUPLICATE at DEBUG (``log_duplicates_at(logging.INFO)`` to see them), RETRY at
WARNING, FAILED at ERROR with the exception's traceback (unless its failed attempt's
WARNING line, dedup.attempt_log, said it: once per distinct error). The traceback is
scrubbed like a reason: its frames (file, line, function, source line) and each
exception of the chain as ``describe`` says it, never str() of a driver's error
(SQLAlchemy's carries the bound parameters), never frame locals or notes.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import traceback
from collections.abc import Iterable, Mapping

from .outcome import Outcome, Result
from .reasons import describe

logger = logging.getLogger("consumerdedup")

_LEVELS = {
    Outcome.PROCESSED: logging.DEBUG,
    Outcome.DUPLICATE: logging.DEBUG,
    Outcome.RETRY: logging.WARNING,
    Outcome.FAILED: logging.ERROR,
}
_CHAIN_LIMIT = 8
"""Exceptions of a chain shown at most (a cause's cause ...): a log line stays a log line."""
_FRAMES_KEPT = 18
"""Frames shown per exception (a driver's error is often 40 deep): both ends kept."""
_CAUSE = "The above exception was the direct cause of the following exception:"
_CONTEXT = "During handling of the above exception, another exception occurred:"


def log_duplicates_at(level: int) -> None:
    """The level of the DUPLICATE lines (DEBUG by default: a redelivery storm is no news;
    INFO to see each one). Process-wide, as logging's own levels are."""
    if level not in (logging.DEBUG, logging.INFO):
        raise ValueError("DUPLICATE lines go at logging.DEBUG or logging.INFO")
    _LEVELS[Outcome.DUPLICATE] = level


class OutcomeCounts:
    """Thread-safe running totals per Outcome, for a metrics exporter to read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(Outcome, 0)

    def add(self, outcome: Outcome) -> None:
        with self._lock:
            self._counts[outcome] += 1

    def add_all(self, outcomes: Iterable[Outcome]) -> None:
        """``add`` of each, under one hold of the lock; the PROCESSED ones (most) counted
        without a dict lookup each (an Enum's hash is Python code)."""
        processed = Outcome.PROCESSED
        done = 0
        others = []
        for outcome in outcomes:
            if outcome is processed:
                done += 1
            else:
                others.append(outcome)
        with self._lock:
            self._counts[processed] += done
            for outcome in others:
                self._counts[outcome] += 1

    def __getitem__(self, outcome: Outcome) -> int:
        return self._counts[outcome]

    def snapshot(self) -> Mapping[Outcome, int]:
        with self._lock:
            return dict(self._counts)

    def __repr__(self) -> str:
        totals = ", ".join(f"{o.value}={n}" for o, n in self.snapshot().items())
        return f"OutcomeCounts({totals})"


def scrubbed_traceback(error: BaseException) -> str:
    """``error``'s traceback as Python prints it, each exception's text replaced by its
    ``describe`` line: where it happened, never the data it carried."""
    chain: list[tuple[BaseException, str]] = []
    seen: set[int] = set()
    current: BaseException | None = error
    joint = ""
    while current is not None and id(current) not in seen and len(chain) < _CHAIN_LIMIT:
        seen.add(id(current))
        chain.append((current, joint))
        if current.__cause__ is not None:
            current, joint = current.__cause__, _CAUSE
        elif current.__context__ is not None and not current.__suppress_context__:
            current, joint = current.__context__, _CONTEXT
        else:
            current = None
    parts: list[str] = []
    for exc, joint in reversed(chain):
        frames = traceback.extract_tb(exc.__traceback__).format()
        if len(frames) > _FRAMES_KEPT:  # the caller's end and the raiser's end
            cut = len(frames) - _FRAMES_KEPT
            head = _FRAMES_KEPT // 3
            frames[head : head + cut] = [f"  ... {cut} frames between ...\n"]
        block = "Traceback (most recent call last):\n" + "".join(frames)
        parts.append(block + describe(exc) + "\n")
        if joint:
            parts.append(f"\n{joint}\n\n")
    return "".join(parts).rstrip("\n")


_SAID = "__consumerdedup_said__"
"""Set on an error whose failed attempt was logged already (dedup.attempt_log), with its
traceback there or before it: its FAILED line then goes without one, so that a deploy's
one bug is one traceback in the log, not one per message."""


def mark_said(error: BaseException) -> None:
    """``error`` was logged as a failed attempt: its outcome line needs no traceback."""
    with contextlib.suppress(AttributeError, TypeError):  # a type without a __dict__
        setattr(error, _SAID, True)


def log_results(consumer: str, results: Iterable[Result]) -> None:
    """``log_result`` of each, in order; the PROCESSED ones skipped at once while their level
    is off (the usual case: one level check for the lot, not one per message)."""
    quiet = not logger.isEnabledFor(_LEVELS[Outcome.PROCESSED])
    processed = Outcome.PROCESSED
    for result in results:
        if not (quiet and result.outcome is processed):
            log_result(consumer, result)


def log_result(consumer: str, result: Result) -> None:
    level = _LEVELS[result.outcome]
    if not logger.isEnabledFor(level):
        return
    message = result.message
    trace = ""
    error = result.error
    if result.outcome is Outcome.FAILED and error is not None and not getattr(error, _SAID, 0):
        trace = "\n" + scrubbed_traceback(error)
    logger.log(
        level,
        "consumer=%s message_id=%r outcome=%s source=%s attempts=%d%s%s",
        consumer,
        message.id,
        result.outcome.value,
        message.source or "-",
        result.attempts,
        f" reason={result.reason}" if result.reason else "",
        trace,
        extra={  # the same fields, for a JSON formatter (`consumerdedup run --log-format json`)
            "consumer": consumer,
            "message_id": message.id,
            "outcome": result.outcome.value,
            "source": message.source,
            "attempts": result.attempts,
            "reason": result.reason,
        },
    )
