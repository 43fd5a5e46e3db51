"""A round as a value (Round), and the pace its parts keep between batches (Pace).

A Round is fixed when the round starts (its ``now``, the cutoffs for each
table, the monotonic start) and handed to every part of it: the partition
dropper, the row batches, the dry-run counts. The Pace is the pruner's: has
stop been asked, tell the progress, pause between batches if configured.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from ..lifecycle import StopSwitch
from .config import PrunerConfig
from .idempotency import KeyCutoffs
from .report import PruneProgress
from .windows import Cutoffs

logger = logging.getLogger("consumerdedup.pruner")

Progress = Callable[[PruneProgress], Any]


@dataclass(frozen=True)
class Round:
    """One round's facts, the same for each of its parts."""

    now: datetime
    """Aware, in UTC (SQLite compares the stored UTC text)."""
    cutoffs: Cutoffs
    """processed_events, per consumer."""
    outbox: datetime | None
    """Published outbox rows older than this go; None: the outbox is left alone."""
    keys: KeyCutoffs
    """HTTP idempotency keys (used only when the config does not leave them alone)."""
    started: float
    """``time.monotonic()`` at the start: progress and the report count from it."""

    @classmethod
    def at(cls, now: datetime, config: PrunerConfig, started: float) -> Round:
        keep = config.outbox_keep
        key_keep = config.idempotency_keep
        return cls(
            now,
            config.keep.cutoffs(now),
            None if keep is None else now - keep,
            KeyCutoffs.at(now, key_keep if isinstance(key_keep, timedelta) else None),
            started,
        )


class Pace:
    """Between two batches of a round: stop asked?, progress told, the configured pause."""

    def __init__(self, switch: StopSwitch, batch_pause: timedelta, progress: Progress | None):
        self.switch = switch
        self.batch_pause = batch_pause
        self.progress = progress
        """Called after every batch; what it raises is logged and the round goes on."""

    @property
    def stopping(self) -> bool:
        return self.switch.stopping

    def tell(self, table: str, deleted: int, state: Round) -> None:
        self.switch.tick()  # a long round is the pruner's loop turning, batch by batch
        elapsed = time.monotonic() - state.started
        logger.debug("pruning %s: %d rows deleted in %.1fs", table, deleted, elapsed)
        if self.progress is not None:
            try:
                self.progress(PruneProgress(table, deleted, elapsed))
            except Exception:
                logger.exception("progress callback %r raised; pruning goes on", self.progress)

    def breathe(self) -> None:
        """Leave the database to the consumers between batches, if asked to; stop() wakes it."""
        if self.batch_pause > timedelta(0):
            self.switch.pause(self.batch_pause.total_seconds())
