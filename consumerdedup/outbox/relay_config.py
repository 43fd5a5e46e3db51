"""RelayConfig: how much a relay round takes, how long an idle relay waits, how failures
back off."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from ..errors import ConfigurationError
from ..retry import Backoff


@dataclass(frozen=True)
class RelayConfig:
    """How much a round takes, how long an idle relay waits, how failures back off."""

    batch_size: int = 100
    """Rows a round claims, publishes and marks in one transaction. On PostgreSQL also the
    most advisory locks the round holds until it commits (one per distinct key), from the
    server's shared lock table (outbox.lock_space; `consumerdedup doctor` checks it)."""
    poll_interval: timedelta = timedelta(seconds=1)
    """Idle wait between rounds; on PostgreSQL a NOTIFY ends it as soon as a row commits."""
    max_attempts: int = 10
    """Failed publishes of one row before this relay parks it: ``parked_at`` is set on the
    row, and no relay tries it again (whatever its own setting) until it is replayed
    (consumerdedup.outbox.parked)."""
    initial_backoff: timedelta = timedelta(milliseconds=200)
    max_backoff: timedelta = timedelta(minutes=5)
    delete_published: bool = False
    """Delete rows once published instead of stamping published_at (the pruner cleans those)."""
    publish_window: int = 500
    """Messages sent before the relay waits for their confirms together (a publisher that
    pipelines: RabbitPublisher, KafkaPublisher). Larger windows pay fewer round trips to
    the broker; a refusal re-sends at most a window's later events of the refused key. It
    takes no lock: the round's locks are its batch_size's."""

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.max_attempts < 1 or self.publish_window < 1:
            raise ConfigurationError("batch_size, max_attempts and publish_window must be >= 1")
        backoff_ok = timedelta(0) <= self.initial_backoff <= self.max_backoff
        if self.poll_interval <= timedelta(0) or not backoff_ok:
            raise ConfigurationError(
                "need poll_interval > 0 and 0 <= initial_backoff <= max_backoff"
            )

    def backoff(self, attempts: int) -> timedelta:
        """Exponential in the row's failed attempts (or the relay's failed rounds), capped."""
        backoff = Backoff(self.initial_backoff, self.max_backoff, jitter=False)
        return timedelta(seconds=backoff.delay(attempts))
