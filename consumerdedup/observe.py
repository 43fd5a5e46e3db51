"""Outcome counters and log lines: what a consumer did, readable without a debugger."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from .outcome import Outcome, Result

logger = logging.getLogger("consumerdedup")

_LEVELS = {
    Outcome.PROCESSED: logging.DEBUG,
    Outcome.DUPLICATE: logging.INFO,
    Outcome.RETRY: logging.WARNING,
    Outcome.FAILED: logging.ERROR,
}


class OutcomeCounts:
    """Thread-safe running totals per Outcome, for a metrics exporter to read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(Outcome, 0)

    def add(self, outcome: Outcome) -> None:
        with self._lock:
            self._counts[outcome] += 1

    def __getitem__(self, outcome: Outcome) -> int:
        return self._counts[outcome]

    def snapshot(self) -> Mapping[Outcome, int]:
        with self._lock:
            return dict(self._counts)

    def __repr__(self) -> str:
        totals = ", ".join(f"{o.value}={n}" for o, n in self.snapshot().items())
        return f"OutcomeCounts({totals})"


def log_result(consumer: str, result: Result) -> None:
    level = _LEVELS[result.outcome]
    if not logger.isEnabledFor(level):
        return
    message = result.message
    logger.log(
        level,
        "consumer=%s key=%r outcome=%s source=%s attempts=%d%s",
        consumer,
        message.id,
        result.outcome.value,
        message.source or "-",
        result.attempts,
        f" reason={result.reason}" if result.reason else "",
        extra={
            "consumer": consumer,
            "message_id": message.id,
            "outcome": result.outcome.value,
        },
    )
