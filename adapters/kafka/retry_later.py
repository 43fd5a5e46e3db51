"""Retry-later scheduling: a partition paused after a RETRY record, and resumed when due.

The partition is sought back to the RETRY record and paused for ``retry_delay``, doubled
per RETRY of the same record in a row up to ``max_retry_delay``; the fetch loop waits no
longer than until the soonest resume.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from consumerdedup import Result
from consumerdedup.retry import Backoff

from . import acks
from .convert import coordinates

logger = logging.getLogger("consumerdedup.kafka")
_RETRY_MEMORY = 10_000
"""Records whose RETRYs in a row are remembered (the oldest are forgotten first)."""


class RetrySchedule:
    """The paused partitions of one run, and the RETRYs in a row of each record."""

    def __init__(self, backoff: Backoff) -> None:
        self.backoff = backoff
        self.paused: dict[Any, float] = {}  # partition -> loop time to resume it
        self._retries: dict[str, int] = {}  # RETRYs in a row per record, for the backoff

    def settled(self, records: Iterable[Any]) -> None:
        """These records were decided: their next RETRY starts the backoff anew."""
        if not self._retries:  # the usual case: no record to forget, no key to build
            return
        for record in records:
            self._retries.pop(coordinates(record), None)

    def forget(self, tp: Any) -> None:
        """``tp`` was revoked: it is no longer paused here."""
        self.paused.pop(tp, None)

    def retry(self, consumer: Any, tp: Any, record: Any, result: Result) -> None:
        """Seek ``tp`` back to ``record`` and pause it for its backoff."""
        key = coordinates(record)
        count = self._retries[key] = self._retries.pop(key, 0) + 1
        while len(self._retries) > _RETRY_MEMORY:
            del self._retries[next(iter(self._retries))]
        delay = self.backoff.delay(count)
        logger.warning(
            "%s will be read again in %.3fs: %s",
            key,
            delay,
            result.reason or "dead letter not sent",
        )
        acks.seek(consumer, tp, record.offset)
        if delay > 0 and tp in consumer.assignment():
            consumer.pause(tp)
            self.paused[tp] = asyncio.get_running_loop().time() + delay

    def resume_due(self, consumer: Any) -> None:
        now = asyncio.get_running_loop().time()
        due = [tp for tp, at in self.paused.items() if at <= now]
        for tp in due:
            del self.paused[tp]
        assigned = consumer.assignment()
        consumer.resume(*(tp for tp in due if tp in assigned))

    def wait_ms(self, poll_timeout: float) -> int:
        """How long the next fetch may wait: ``poll_timeout`` seconds, or less if a paused
        partition is due sooner."""
        wait = poll_timeout
        if self.paused:
            soonest = min(self.paused.values()) - asyncio.get_running_loop().time()
            wait = max(0.0, min(wait, soonest))
        return int(wait * 1000)
