"""The schedule loop: a round every ``every`` until stop(), failed rounds retried sooner.

A failed round (the database away) is logged and tried again after 2 s, 4 s,
... at most 512 s and never longer than a period; a round skipped because
another pruner held the lock is tried again after ``busy_retry`` (at most a
period). A period counts from the start of a round, so a long round does not
push the next one back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ..lifecycle import StopSwitch
from ..reasons import describe
from ..retry import Backoff
from .report import PruneReport
from .windows import check_window

logger = logging.getLogger("consumerdedup.pruner")

FAILED_ROUND_FIRST = timedelta(seconds=2)
FAILED_ROUND_LONGEST = timedelta(seconds=512)
BUSY_RETRY = timedelta(minutes=1)
"""When another pruner held the lock, try again this soon rather than a period later."""


def run_every(
    switch: StopSwitch,
    round_once: Callable[[], PruneReport],
    every: timedelta,
    *,
    on_report: Callable[[PruneReport], Any] | None = None,
    busy_retry: timedelta = BUSY_RETRY,
) -> int:
    """``round_once()`` every ``every`` until ``switch`` stops; returns the rows deleted."""
    period = check_window(every, "every", allow_none=False)
    retry = check_window(busy_retry, "busy_retry", allow_none=False)
    assert period is not None and retry is not None
    longest = min(period, FAILED_ROUND_LONGEST)
    backoff = Backoff(min(FAILED_ROUND_FIRST, longest), longest, jitter=False)
    total = failures = 0
    while not switch.stopping:
        switch.tick()
        started = time.monotonic()
        try:
            report = round_once()
        except Exception as exc:
            failures += 1
            delay = backoff.delay(failures)
            logger.warning("prune round failed (%s); retrying in %.0fs", describe(exc), delay)
            switch.pause(delay)
            continue
        failures = 0
        total += report.total
        if on_report is not None:
            on_report(report)
        wait = min(period, retry) if report.skipped else period
        switch.pause(max(wait.total_seconds() - (time.monotonic() - started), 0.0))
    return total
