"""What a pruner tells: PruneProgress after every batch, PruneReport after every round."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

logger = logging.getLogger("consumerdedup.pruner")


@dataclass(frozen=True)
class PruneProgress:
    """Told after every batch: how far the round has got in one table."""

    table: str
    deleted: int
    seconds: float

    @property
    def rate(self) -> float:
        """Rows deleted per second so far."""
        return self.deleted / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class PruneReport:
    """What one round did (or, in a dry run, would do)."""

    deleted: Mapping[str, int] = field(default_factory=dict)
    """processed_events rows per consumer."""
    outbox: int = 0
    """Published outbox rows."""
    cutoffs: Mapping[str, datetime | None] = field(default_factory=dict)
    """Per consumer named in the windows (``"*"``: every other one): rows older than this go;
    None: kept forever."""
    dry_run: bool = False
    skipped: bool = False
    """Another pruner held the lock: this round did nothing."""
    stopped: bool = False
    """stop() was asked during the round: it ended after the batch in flight."""
    partitions: tuple[str, ...] = ()
    """Partitions of processed_events dropped whole (dry run: that would be); their rows
    are counted in ``deleted``."""
    seconds: float = 0.0
    idempotency_keys: int = 0
    """Expired HTTP idempotency-key records."""

    @property
    def total(self) -> int:
        return sum(self.deleted.values()) + self.outbox + self.idempotency_keys


def log_report(report: PruneReport) -> None:
    """One info line per round that ran (a skipped round said why when it skipped)."""
    if report.skipped:
        return
    verb = "would delete" if report.dry_run else "deleted"
    per = ", ".join(f"{c}={n}" for c, n in sorted(report.deleted.items())) or "none"
    logger.info(
        "%s %d processed_events rows (%s)%s, %d published outbox rows and %d expired "
        "idempotency keys in %.1fs%s",
        verb,
        sum(report.deleted.values()),
        per,
        f", {len(report.partitions)} partitions whole" if report.partitions else "",
        report.outbox,
        report.idempotency_keys,
        report.seconds,
        " (stopped early)" if report.stopped else "",
    )
