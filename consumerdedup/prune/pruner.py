"""Pruner: deletes dedup records no redelivery can need any more, in small batches.

The rule: a processed_events row is deleted only when its processed_at is
older than now - (retention + buffer) for its consumer; a row exactly at that
cutoff is kept. A range-partitioned processed_events loses whole partitions
first: those whose every row is past every consumer's cutoff. Published
outbox rows go once older than ``outbox_keep``; unpublished ones are never
touched. HTTP idempotency keys go once past the expiry stored with each, or
older than ``idempotency_keep`` (see prune/idempotency.py); a claim in flight
never goes while its lease holds. Each batch (``batch_size`` rows) is its own
short transaction. On PostgreSQL one pruner works at a time per table (a
session advisory lock held for the round; the others skip the round and say
so); on SQLite the database's write lock serializes the batches instead; on
MySQL and MariaDB pruners may run side by side (no advisory lock: GET_LOCK is
session-scoped and node-local on Galera), each batch row-locking the rows it
deletes, so two pruners delete each row once.

The parts: what to delete is a PrunerConfig (config.py) and, per round, a
Round (rounds.py) with the cutoffs of windows.py; the PartitionDropper
(dropper.py) and the RowPruner (rows.py) carry out the round; run_every
(schedule.py) repeats it. This module holds them together: the lock, the
order of the parts, the report.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine

from ..db.dialects import require_fixed_schema, require_supported
from ..errors import ConfigurationError
from ..lifecycle import StopSwitch
from ..options import function, instance, maybe
from ..schema import DEFAULT, Tables, utcnow
from .config import DEFAULT_BATCH, DEFAULT_OUTBOX_KEEP, PrunerConfig, PrunerSettings
from .dropper import PartitionDropper
from .idempotency import KeyPruneStatements
from .report import PruneProgress, PruneReport, log_report
from .rounds import Pace, Progress, Round
from .rows import RowPruner
from .schedule import BUSY_RETRY, run_every
from .statements import PruneStatements
from .windows import UnknownConsumer, Window

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "BUSY_RETRY",
    "DEFAULT_BATCH",
    "DEFAULT_OUTBOX_KEEP",
    "PruneProgress",
    "PruneReport",
    "Pruner",
    "PrunerConfig",
]

logger = logging.getLogger("consumerdedup.pruner")


class _Unset(enum.Enum):
    UNSET = "not given"

    def __repr__(self) -> str:
        return "<not given>"


UNSET = _Unset.UNSET


class Pruner(StopSwitch):
    """Deletes processed_events rows older than retention + buffer, and old published outbox rows.

    ``config`` says what goes and how fast (see PrunerConfig);
    ``Pruner(engine, retention, buffer, windows=..., ...)`` is a shortcut for
    ``Pruner(engine, config=PrunerConfig(retention, buffer, windows=..., ...))``;
    the keywords are ``windows``, ``consumers``, ``outbox_keep``,
    ``idempotency_keep``, ``batch_size``, ``batch_pause`` and ``dry_run``.
    ``progress`` is called after every batch with a PruneProgress; ``clock``
    gives the time a round's cutoffs count back from (timezone-aware).
    """

    def __init__(
        self,
        engine: Engine,
        retention: Window | _Unset = UNSET,
        buffer: timedelta | None = None,
        *,
        config: PrunerConfig | None = None,
        tables: Tables = DEFAULT,
        progress: Progress | None = None,
        clock: Callable[[], datetime] = utcnow,
        **settings: Unpack[PrunerSettings],
    ) -> None:
        super().__init__()
        instance(engine, "Pruner.engine", Engine, "a sqlalchemy Engine (create_engine(...))")
        config = maybe(config, "Pruner.config", instance, PrunerConfig, "a PrunerConfig or None")
        tables = instance(tables, "Pruner.tables", Tables, "a Tables (Tables.define(...))")
        maybe(progress, "Pruner.progress", function, blocking=True)
        function(clock, "Pruner.clock", "a callable returning an aware datetime", blocking=True)
        require_supported(engine.dialect.name)
        require_fixed_schema(engine.get_execution_options(), "Pruner")
        if config is None:
            if retention is UNSET:
                raise TypeError("Pruner() needs a retention, or config=PrunerConfig(...)")
            config = PrunerConfig(retention, buffer, **settings)
        elif retention is not UNSET or buffer is not None or settings:
            raise ConfigurationError(
                "Pruner: give config=PrunerConfig(...) or the settings as arguments, not both"
            )
        self.engine = engine
        self.config = config
        self.tables = tables
        self.clock = clock
        self.postgres = engine.dialect.name == "postgresql"
        self.mysql = engine.dialect.name in ("mysql", "mariadb")
        self.pace = Pace(self, config.batch_pause, progress)
        keep = config.keep
        self.statements = PruneStatements(
            tables, engine.dialect.name, list(keep.named), others=keep.others is not None
        )
        keys = None
        if config.idempotency_keep is not None:
            keys = KeyPruneStatements(tables.idempotency_keys, engine.dialect.name)
        self.rows = RowPruner(self.statements, keys, tables, config.batch_size, self.pace)
        self.dropper = PartitionDropper(tables, self.pace) if self.postgres else None
        self.last: PruneReport | None = None

    @property
    def progress(self) -> Progress | None:
        """Called after every batch; may be replaced between rounds."""
        return self.pace.progress

    @progress.setter
    def progress(self, value: Progress | None) -> None:
        self.pace.progress = value

    def prune(self) -> int:
        """One round; returns how many rows it deleted (in a dry run: would delete)."""
        return self.run_once().total

    def run_once(self) -> PruneReport:
        """One round: whole partitions, every expired batch of processed_events, then the rest."""
        started = time.monotonic()
        state = Round.at(self._now(), self.config, started)
        with self.engine.connect() as conn:
            if self.mysql:  # a batch's locking read takes no gap locks (claims insert freely)
                conn.execution_options(isolation_level="READ COMMITTED")
            if self.config.dry_run:
                report = self._count(conn, state)
            elif self.postgres and not self._lock(conn):
                logger.info(
                    "another pruner holds the lock on %s: skipping this round",
                    self.tables.processed_events.fullname,
                )
                report = PruneReport(cutoffs=state.cutoffs.shown, skipped=True)
            else:
                report = self._delete(conn, state)
        report = replace(report, seconds=time.monotonic() - started)
        log_report(report)
        self.last = report
        return report

    def run(
        self,
        every: timedelta,
        *,
        on_report: Callable[[PruneReport], Any] | None = None,
        busy_retry: timedelta = BUSY_RETRY,
    ) -> int:
        """A round every ``every`` until stop() (or SIGTERM after on_signals()); returns the total.

        A failed round (the database away) is logged and tried again with a
        growing delay, never longer than ``every`` (see schedule.py).
        """
        self._set_ready(True)
        try:
            return run_every(self, self.run_once, every, on_report=on_report, busy_retry=busy_retry)
        finally:
            self._set_ready(False)

    def check_consumers(self) -> None:
        """Raise UnknownConsumer if a consumer named in ``consumers`` or ``windows`` has no records.

        A misspelt name would otherwise prune nothing, or prune a consumer with
        the default window instead of its own. ``prune()`` does not call this:
        a consumer whose records all expired is not an error for a scheduled pruner.
        """
        names = sorted(set(self.config.consumers or ()) | set(self.config.windows or ()))
        with self.engine.connect() as conn:
            missing = [n for n in names if not self.statements.has_records(conn, n)]
            if not missing:
                return
            known = self.statements.consumers(conn)
        table = self.tables.processed_events.fullname
        listed = ", ".join(known[:20]) + (", ..." if len(known) > 20 else "") or "none"
        raise UnknownConsumer(
            f"unknown consumer(s) {', '.join(map(repr, missing))}: no records in {table} "
            f"(consumers with records: {listed})"
        )

    # --- the round ------------------------------------------------------------------------

    def _now(self) -> datetime:
        now = self.clock()
        if now.tzinfo is None:
            raise ConfigurationError("the pruner's clock must return timezone-aware datetimes")
        return now.astimezone(UTC)  # SQLite compares the stored UTC text

    def _delete(self, conn: Connection, state: Round) -> PruneReport:
        """Partitions whole, then the row batches; on PostgreSQL under the lock taken."""
        try:
            deleted: Counter[str] = Counter()
            dropped: list[str] = []
            if self.dropper is not None:
                deleted, dropped = self.dropper.drop(conn, state)
            deleted += self.rows.events(conn, state, sum(deleted.values()))
            outbox = self.rows.outbox(conn, state)
            keys = self.rows.keys(conn, state)
        finally:
            if self.postgres:
                self._unlock(conn)
        return PruneReport(
            deleted,
            outbox,
            state.cutoffs.shown,
            stopped=self.stopping,
            partitions=tuple(dropped),
            idempotency_keys=keys,
        )

    def _count(self, conn: Connection, state: Round) -> PruneReport:
        """A dry run: what the round would delete, and nothing deleted."""
        events, outbox = self.rows.count(conn, state)
        partitions = () if self.dropper is None else self.dropper.expired(conn, state.cutoffs)
        keys = self.rows.count_keys(conn, state)
        return PruneReport(
            events,
            outbox,
            state.cutoffs.shown,
            dry_run=True,
            partitions=partitions,
            idempotency_keys=keys,
        )

    def _lock(self, conn: Connection) -> bool:
        locked = self.statements.try_lock(conn)
        conn.commit()  # the session lock outlives it; each batch is a transaction of its own
        return locked

    def _unlock(self, conn: Connection) -> None:
        try:
            if conn.in_transaction():
                conn.rollback()
            self.statements.unlock(conn)
            conn.commit()
        except Exception:
            conn.invalidate()  # closing the connection releases the lock on the server
