"""RelayConfig: how much a relay round takes, how long an idle relay waits, how failures
back off."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from ..options import boolean, duration, integer, refuse, settle
from ..retry import Backoff


@dataclass(frozen=True)
class RelayConfig:
    """How much a round takes, how long an idle relay waits, how failures back off."""

    batch_size: int = 100
    """Rows a round claims, publishes and marks in one transaction. On PostgreSQL also the
    most advisory locks the round holds until it commits (one per distinct key), from the
    server's shared lock table (outbox.lock_space; `consumerdedup doctor` checks it). On
    MySQL and MariaDB the most rows it row-locks (its scan reads up to four times as many
    without locking)."""
    poll_interval: timedelta = timedelta(seconds=1)
    """Idle wait between rounds; on PostgreSQL a NOTIFY ends it as soon as a row commits. On
    MySQL and MariaDB a commit through Outbox.add in this process ends it; rows from other
    processes wait for it, varied by +-20% (outbox.listener.JITTER)."""
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
        for name in ("batch_size", "max_attempts", "publish_window"):
            settle(self, name, integer(getattr(self, name), f"RelayConfig.{name}", at_least=1))
        settle(self, "poll_interval", duration(self.poll_interval, "RelayConfig.poll_interval"))
        for name in ("initial_backoff", "max_backoff"):
            settle(self, name, duration(getattr(self, name), f"RelayConfig.{name}", zero=True))
        if self.max_backoff < self.initial_backoff:
            raise refuse(
                "RelayConfig.max_backoff",
                self.max_backoff,
                f">= initial_backoff ({self.initial_backoff})",
            )
        settle(
            self, "delete_published", boolean(self.delete_published, "RelayConfig.delete_published")
        )

    def backoff(self, attempts: int) -> timedelta:
        """Exponential in the row's failed attempts (or the relay's failed rounds), capped."""
        backoff = Backoff(self.initial_backoff, self.max_backoff, jitter=False)
        return timedelta(seconds=backoff.delay(attempts))
