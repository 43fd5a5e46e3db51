"""MemoryConfig: how a MemoryConsumerRunner consumes and retries, in the brokers' words.

Each field has the name, type and default of the same field of KafkaConfig or
RabbitConfig (tests/project/test_adapter_symmetry.py checks it), so a consumer
tested on the MemoryBroker is configured as it will be in production.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from ..options import duration, integer, maybe, settle, text
from ..retry import Backoff


@dataclass(frozen=True)
class MemoryConfig:
    """Consumer settings, validated at construction; durations are ``timedelta``."""

    batch_size: int = 100
    """Messages per fetch at most; they run as one database transaction."""
    poll_timeout: timedelta = timedelta(milliseconds=500)
    """Longest wait for a message: bounds how late ``stop()`` is noticed when idle."""
    retry_delay: timedelta = timedelta(seconds=1)
    """First wait before a RETRY message is given back; doubles per RETRY of the same
    message in a row, up to ``max_retry_delay``. ``timedelta(0)`` in fast tests."""
    max_retry_delay: timedelta = timedelta(seconds=30)
    connection_name: str | None = None
    """The consumer's name at the broker (what ``disconnect`` gives back); None: made up."""

    def __post_init__(self) -> None:
        option = "MemoryConfig."
        settle(self, "batch_size", integer(self.batch_size, option + "batch_size", at_least=1))
        settle(self, "poll_timeout", duration(self.poll_timeout, option + "poll_timeout"))
        delay = duration(self.retry_delay, option + "retry_delay", zero=True)
        settle(self, "retry_delay", delay)
        longest = duration(self.max_retry_delay, option + "max_retry_delay", at_least=delay)
        settle(self, "max_retry_delay", longest)
        maybe(self.connection_name, option + "connection_name", text)

    @property
    def redelivery_backoff(self) -> Backoff:
        """Before a RETRY message is given back, by its RETRYs in a row."""
        return Backoff(self.retry_delay, self.max_retry_delay, jitter=False)
