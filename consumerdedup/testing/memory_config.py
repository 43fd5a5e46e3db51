"""MemoryConfig: how a MemoryConsumerRunner consumes and retries, in the brokers' words.

Each field has the name, type and default of the same field of KafkaConfig or
RabbitConfig (tests/project/test_adapter_symmetry.py checks it), so a consumer
tested on the MemoryBroker is configured as it will be in production.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from ..errors import ConfigurationError
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
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigurationError(f"batch_size must be an int >= 1, got {self.batch_size!r}")
        if self.poll_timeout <= timedelta(0):
            raise ConfigurationError("poll_timeout must be positive")
        if self.retry_delay < timedelta(0):
            raise ConfigurationError("retry_delay must not be negative")
        if self.max_retry_delay < self.retry_delay:
            raise ConfigurationError("need retry_delay <= max_retry_delay")
        if self.connection_name is not None and not self.connection_name:
            raise ConfigurationError("connection_name must be a non-empty str or None")

    @property
    def redelivery_backoff(self) -> Backoff:
        """Before a RETRY message is given back, by its RETRYs in a row."""
        return Backoff(self.retry_delay, self.max_retry_delay, jitter=False)
