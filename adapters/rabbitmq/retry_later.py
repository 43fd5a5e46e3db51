"""Retry-later scheduling: how long a batch's RETRY deliveries back off before their nack.

Each delivery's wait grows with its RETRYs in a row (``retry_delay`` doubled up to
``max_retry_delay``); a batch waits for the longest of its RETRYs, answering heartbeats
meanwhile, then nacks them with requeue.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from consumerdedup import Message
from consumerdedup.retry import Backoff

POLL = 0.1
"""Longest wait on the socket, so stop() from another thread or a signal is seen quickly."""
_RETRY_MEMORY = 10_000
"""Ids whose RETRYs in a row are remembered (the oldest are forgotten first)."""


class RetrySchedule:
    """The RETRYs in a row of each message id, and the backoff they make."""

    def __init__(self, backoff: Backoff) -> None:
        self.backoff = backoff
        self._retries: dict[str, int] = {}  # consecutive RETRYs per id, for the backoff

    @property
    def empty(self) -> bool:
        """No RETRY remembered: settling a message has nothing to forget."""
        return not self._retries

    def settled(self, message: Message) -> None:
        """``message`` was decided: its next RETRY starts the backoff anew."""
        if self._retries:  # nothing remembered (the usual case): nothing to forget
            self._retries.pop(str(message.id), None)

    def delay(self, messages: Iterable[Message]) -> float:
        """The longest wait of ``messages``, each by its RETRYs in a row."""
        wait = 0.0
        for message in messages:
            key = str(message.id)
            count = self._retries[key] = self._retries.pop(key, 0) + 1
            wait = max(wait, self.backoff.delay(count))
        while len(self._retries) > _RETRY_MEMORY:
            del self._retries[next(iter(self._retries))]
        return wait


def wait(connection: Any, seconds: float, stopping: Callable[[], bool]) -> None:
    """Sleep while answering heartbeats; ``stopping()`` cuts it short."""
    deadline = time.monotonic() + seconds
    while not stopping() and (left := deadline - time.monotonic()) > 0:
        connection.process_data_events(time_limit=min(left, POLL))
