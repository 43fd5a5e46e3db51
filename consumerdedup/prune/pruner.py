"""Pruner: deletes dedup records no redelivery can need any more, in small batches.

The rule: a processed_events row is deleted only when its processed_at is
older than now - (retention + buffer) for its consumer; a row exactly at that
cutoff is kept. A range-partitioned processed_events loses whole partitions
first: those whose every row is past every consumer's cutoff. Published
outbox rows go once older than ``outbox_keep``; unpublished ones are never
touched. HTTP idempotency keys go once past the expiry stored with each, or
older than ``idempotency_keep`` (see prune/idempotency.py); a claim in flight
never goes while its lease holds. Each batch (``batch_size`` rows) is its own short transaction. On
PostgreSQL one pruner works at a time per table (a session advisory lock
held for the round; the others skip the round and say so); on SQLite the
database's write lock serializes the batches instead.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError

from ..db import sqlite
from ..db.dialects import require_supported
from ..db.partitions import DayPartitions
from ..errors import ConfigurationError
from ..lifecycle import StopSwitch
from ..reasons import describe
from ..retry import Backoff
from ..schema import DEFAULT, Tables, utcnow
from .idempotency import EXPIRY, KeyCutoffs, KeyPruneStatements
from .statements import EARLIEST, PruneStatements
from .windows import UnknownConsumer, Window, check_window, default_buffer, plain, scoped

logger = logging.getLogger("consumerdedup.pruner")

DEFAULT_BATCH = 5000
DEFAULT_OUTBOX_KEEP = timedelta(days=7)
FAILED_ROUND_FIRST = timedelta(seconds=2)
FAILED_ROUND_LONGEST = timedelta(seconds=512)
BUSY_RETRY = timedelta(minutes=1)
"""``run``: when another pruner held the lock, try again this soon rather than a period later."""


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


class Pruner(StopSwitch):
    """Deletes processed_events rows older than retention + buffer, and old published outbox rows.

    ``retention`` applies to every consumer without a window of its own in
    ``windows`` (a mapping of consumer name to timedelta, or None to keep that
    consumer's records forever); ``retention=None`` prunes only the consumers
    in ``windows``. ``consumers`` restricts the round to the consumers named.
    A ``BrokerRetention`` (``kafka_retention``, ``rabbitmq_retention``) as
    ``retention`` needs ``consumers``: it is only the window of its topics or
    queues; as a value in ``windows``, it is that consumer's.
    ``buffer`` defaults to max(1 day, 10% of each consumer's retention).
    Each batch of ``batch_size`` rows is a transaction; ``batch_pause`` between
    batches leaves more of the database to the consumers on a busy server.
    ``idempotency_keep``: EXPIRY (the default) deletes the HTTP idempotency keys
    past the expiry stored with each; a timedelta also those created longer ago;
    None leaves that table alone.
    """

    def __init__(
        self,
        engine: Engine,
        retention: Window,
        buffer: timedelta | None = None,
        *,
        windows: Mapping[str, Window] | None = None,
        consumers: Iterable[str] | None = None,
        outbox_keep: timedelta | None = DEFAULT_OUTBOX_KEEP,
        idempotency_keep: timedelta | str | None = EXPIRY,
        tables: Tables = DEFAULT,
        batch_size: int = DEFAULT_BATCH,
        batch_pause: timedelta = timedelta(0),
        dry_run: bool = False,
        progress: Callable[[PruneProgress], Any] | None = None,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        super().__init__()
        require_supported(engine.dialect.name)
        common = check_window(scoped(retention, consumers), "retention")
        buffer = check_window(buffer, "buffer")  # None: the default, per window
        own = {
            name: check_window(plain(window), f"window of consumer {_name(name)!r}")
            for name, window in (windows or {}).items()
        }
        selected = None if consumers is None else sorted({_name(c) for c in consumers})
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigurationError(f"batch_size must be an int >= 1, not {batch_size!r}")
        if not isinstance(batch_pause, timedelta) or batch_pause < timedelta(0):
            raise ConfigurationError(f"batch_pause must be a timedelta >= 0, not {batch_pause!r}")

        def keep(window: timedelta | None) -> timedelta | None:
            return None if window is None else window + (buffer or default_buffer(window))

        named = selected if selected is not None else sorted(own)
        self.keep: dict[str, timedelta | None] = {
            name: keep(own.get(name, common)) for name in named
        }
        """Per consumer named: how old a record must be before it goes (None: never)."""
        self.keep_others = keep(common) if selected is None else None
        self.consumers = selected
        self.windows = own
        self.outbox_keep = check_window(outbox_keep, "outbox_keep")
        if idempotency_keep is not None and idempotency_keep != EXPIRY:
            check_window(idempotency_keep, f"idempotency_keep (or {EXPIRY!r}, or None)")
        self.idempotency_keep = idempotency_keep
        """EXPIRY, a timedelta, or None (idempotency keys left alone)."""
        self.engine = engine
        self.tables = tables
        self.batch_size = batch_size
        self.batch_pause = batch_pause
        self.dry_run = dry_run
        self.progress = progress
        self.clock = clock
        self.postgres = engine.dialect.name == "postgresql"
        self.partitions = DayPartitions(tables.processed_events) if self.postgres else None
        self.statements = PruneStatements(
            tables, engine.dialect.name, named, others=self.keep_others is not None
        )
        self.key_statements = (
            None
            if idempotency_keep is None
            else KeyPruneStatements(tables.idempotency_keys, engine.dialect.name)
        )
        self.last: PruneReport | None = None

    def prune(self) -> int:
        """One round; returns how many rows it deleted (in a dry run: would delete)."""
        return self.run_once().total

    def run_once(self) -> PruneReport:
        """One round: every expired batch of processed_events, then of the outbox."""
        started = time.monotonic()
        now = self._now()
        cutoffs = {name: None if k is None else now - k for name, k in self.keep.items()}
        others = None if self.keep_others is None else now - self.keep_others
        shown = {**cutoffs, **({"*": others} if others is not None else {})}
        outbox_cutoff = None if self.outbox_keep is None else now - self.outbox_keep
        params = self.statements.params(cutoffs, others)
        with self.engine.connect() as conn:
            if self.dry_run:
                report = self._count(conn, params, outbox_cutoff, shown)
                report = replace(
                    report,
                    partitions=self._expired_partitions(conn, cutoffs, others),
                    idempotency_keys=self._count_keys(conn, now),
                )
            elif self.postgres and not self._lock(conn):
                logger.info(
                    "another pruner holds the lock on %s: skipping this round",
                    self.tables.processed_events.fullname,
                )
                report = PruneReport(cutoffs=shown, skipped=True)
            else:
                try:
                    deleted, dropped = self._drop_partitions(conn, now, cutoffs, others, started)
                    deleted += self._delete_events(conn, params, started, sum(deleted.values()))
                    outbox = self._delete_outbox(conn, outbox_cutoff, started)
                    keys = self._delete_keys(conn, now, started)
                finally:
                    if self.postgres:
                        self._unlock(conn)
                report = PruneReport(
                    deleted,
                    outbox,
                    shown,
                    stopped=self.stopping,
                    partitions=tuple(dropped),
                    idempotency_keys=keys,
                )
        report = replace(report, seconds=time.monotonic() - started)
        self._log(report)
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
        growing delay, never longer than ``every``.
        """
        period = check_window(every, "every", allow_none=False)
        retry = check_window(busy_retry, "busy_retry", allow_none=False)
        assert period is not None and retry is not None
        # 2s, 4s, ... at most 512s (never longer than a period) between failed rounds.
        longest = min(period, FAILED_ROUND_LONGEST)
        backoff = Backoff(min(FAILED_ROUND_FIRST, longest), longest, jitter=False)
        total = failures = 0
        while not self.stopping:
            started = time.monotonic()
            try:
                report = self.run_once()
            except Exception as exc:
                failures += 1
                delay = backoff.delay(failures)
                logger.warning("prune round failed (%s); retrying in %.0fs", describe(exc), delay)
                self.pause(delay)
                continue
            failures = 0
            total += report.total
            if on_report is not None:
                on_report(report)
            wait = min(period, retry) if report.skipped else period
            self.pause(max(wait.total_seconds() - (time.monotonic() - started), 0.0))
        return total

    def check_consumers(self) -> None:
        """Raise UnknownConsumer if a consumer named in ``consumers`` or ``windows`` has no records.

        A misspelt name would otherwise prune nothing, or prune a consumer with
        the default window instead of its own. ``prune()`` does not call this:
        a consumer whose records all expired is not an error for a scheduled pruner.
        """
        names = sorted(set(self.consumers or ()) | set(self.windows))
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

    # --- the round's parts ------------------------------------------------------------------

    def _now(self) -> datetime:
        now = self.clock()
        if now.tzinfo is None:
            raise ConfigurationError("the pruner's clock must return timezone-aware datetimes")
        return now.astimezone(UTC)  # SQLite compares the stored UTC text

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

    def _drop_threshold(
        self, cutoffs: Mapping[str, datetime | None], others: datetime | None
    ) -> datetime | None:
        """Whole partitions may go up to the earliest cutoff, if every consumer has one."""
        if self.consumers is not None or others is None:
            return None  # some consumers' records are not this round's to delete
        if any(cutoff is None for cutoff in cutoffs.values()):
            return None  # a partition holds every consumer's rows: one kept forever keeps it
        return min([others, *(c for c in cutoffs.values() if c is not None)])

    def _expired_partitions(
        self,
        conn: Connection,
        cutoffs: Mapping[str, datetime | None],
        others: datetime | None,
    ) -> tuple[str, ...]:
        threshold = self._drop_threshold(cutoffs, others)
        if self.partitions is None or threshold is None:
            return ()
        if not self.partitions.is_partitioned(conn):
            return ()
        return tuple(p.name for p in self.partitions.expired(conn, threshold))

    def _drop_partitions(
        self,
        conn: Connection,
        now: datetime,
        cutoffs: Mapping[str, datetime | None],
        others: datetime | None,
        started: float,
    ) -> tuple[Counter[str], list[str]]:
        """Partitioned processed_events: make the days ahead, drop the days wholly expired.

        A partition goes only when its upper bound is at or before every
        consumer's cutoff, so each of its rows is older than its own window. A
        drop that cannot get its lock in time is skipped: the batch deletes
        that follow take those rows instead.
        """
        deleted: Counter[str] = Counter()
        dropped: list[str] = []
        if self.partitions is None:
            return deleted, dropped
        with conn.begin():
            if not self.partitions.is_partitioned(conn):
                return deleted, dropped
            self.partitions.make_ahead(conn, now)
        threshold = self._drop_threshold(cutoffs, others)
        if threshold is None:
            return deleted, dropped
        with conn.begin():
            expired = self.partitions.expired(conn, threshold)
        table = self.tables.processed_events.fullname
        for partition in expired:
            if self.stopping:
                break
            try:
                with conn.begin():
                    counts = self.partitions.count(conn, partition)
                    self.partitions.drop(conn, partition)
            except DBAPIError as error:
                logger.warning("partition %s not dropped (%s)", partition.name, describe(error))
                continue
            deleted.update(counts)
            dropped.append(partition.name)
            logger.info("dropped partition %s (%d rows)", partition.name, counts.total())
            self._tell(table, deleted.total(), started)
        return deleted, dropped

    def _delete_events(
        self, conn: Connection, params: dict[str, Any], started: float, before: int = 0
    ) -> Counter[str]:
        deleted: Counter[str] = Counter()
        if params["upper"] is None:
            return deleted
        lower = EARLIEST
        table = self.tables.processed_events.fullname
        while not self.stopping:
            with sqlite.transaction(conn):  # BEGIN IMMEDIATE on SQLite
                batch = self.statements.delete_batch(
                    conn, {**params, "lower": lower}, self.batch_size
                )
            deleted.update(batch.deleted)
            self._tell(table, before + sum(deleted.values()), started)
            if batch.total < self.batch_size or batch.last is None:
                break
            lower = batch.last  # rows at exactly this time that are left still qualify
            self._breathe()
        return deleted

    def _delete_outbox(self, conn: Connection, cutoff: datetime | None, started: float) -> int:
        deleted = 0
        table = self.tables.outbox.fullname
        while cutoff is not None and not self.stopping:
            with sqlite.transaction(conn):
                count = self.statements.delete_outbox(conn, cutoff, self.batch_size)
            deleted += count
            self._tell(table, deleted, started)
            if count < self.batch_size:
                break
            self._breathe()
        return deleted

    def _key_cutoffs(self, now: datetime) -> KeyCutoffs:
        keep = self.idempotency_keep
        return KeyCutoffs.at(now, keep if isinstance(keep, timedelta) else None)

    def _key_table(self, conn: Connection) -> KeyPruneStatements | None:
        statements = self.key_statements
        if statements is None or not statements.exists(conn):
            return None  # left alone, or a database from before idempotency keys existed
        conn.commit()  # the look-up's transaction; each batch is one of its own
        return statements

    def _delete_keys(self, conn: Connection, now: datetime, started: float) -> int:
        statements = self._key_table(conn)
        if statements is None:
            return 0
        cutoffs, deleted = self._key_cutoffs(now), 0
        table = self.tables.idempotency_keys.fullname
        for kind in statements.kinds:
            while not self.stopping:
                with sqlite.transaction(conn):
                    count = statements.delete_batch(conn, cutoffs, self.batch_size, kind)
                deleted += count
                if count:  # most rounds find none: no progress line for an empty look
                    self._tell(table, deleted, started)
                if count < self.batch_size:
                    break
                self._breathe()
        return deleted

    def _count_keys(self, conn: Connection, now: datetime) -> int:
        statements = self._key_table(conn)
        return 0 if statements is None else statements.count(conn, self._key_cutoffs(now))

    def _breathe(self) -> None:
        """Leave the database to the consumers between batches, if asked to; stop() wakes it."""
        if self.batch_pause > timedelta(0):
            self.pause(self.batch_pause.total_seconds())

    def _count(
        self,
        conn: Connection,
        params: dict[str, Any],
        outbox_cutoff: datetime | None,
        shown: dict[str, datetime | None],
    ) -> PruneReport:
        events = self.statements.count(conn, params) if params["upper"] is not None else Counter()
        outbox = 0 if outbox_cutoff is None else self.statements.count_outbox(conn, outbox_cutoff)
        return PruneReport(events, outbox, shown, dry_run=True)

    def _tell(self, table: str, deleted: int, started: float) -> None:
        elapsed = time.monotonic() - started
        logger.debug("pruning %s: %d rows deleted in %.1fs", table, deleted, elapsed)
        if self.progress is not None:
            try:
                self.progress(PruneProgress(table, deleted, elapsed))
            except Exception:
                logger.exception("progress callback %r raised; pruning goes on", self.progress)

    def _log(self, report: PruneReport) -> None:
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


def _name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"a consumer name must be a non-empty str, not {name!r}")
    return name
