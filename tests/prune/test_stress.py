"""Pruning a million expired rows on PostgreSQL while a consumer keeps processing."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from typing import Any

import pytest
from sqlalchemy import text

from consumerdedup import Deduplicator, Message, Outcome, Pruner
from tests.conftest import Database

MAX_STALL_SHARE = 0.75
"""Of a batch prune's run, the longest a consumer beside it may go without a commit."""


@pytest.mark.slow
@pytest.mark.postgres
def test_a_million_expired_rows_go_while_a_consumer_keeps_working(pg: Database) -> None:
    """Bulk pruning must not stall the consumer, nor touch a row inside the window.

    The pruner's clock is pinned to the moment the rows were written, so the
    young rows sit exactly inside the window whatever the machine's speed.
    """
    pe = pg.name("processed_events")
    ledger = pg.create_ledger()
    t0 = datetime.now(UTC).replace(microsecond=0)
    with pg.engine.begin() as conn:
        conn.execute(
            text(
                f"INSERT INTO {pe} (consumer, message_id, processed_at, payload_hash, outcome) "
                "SELECT 'ledger', 'old-' || i, :t0 - interval '8 days' - i * interval '1 ms', "
                "repeat('a', 64), 'processed' FROM generate_series(1, 1000000) AS i"
            ),
            {"t0": t0},
        )
        conn.execute(  # from exactly the cutoff to a day younger
            text(
                f"INSERT INTO {pe} (consumer, message_id, processed_at, payload_hash, outcome) "
                "SELECT 'ledger', 'young-' || i, :t0 - interval '8 days' + i * interval '8 s', "
                "repeat('a', 64), 'processed' FROM generate_series(0, 9999) AS i"
            ),
            {"t0": t0},
        )
        conn.execute(text(f"ANALYZE {pe}"))

    consumer = LiveConsumer(pg, ledger)
    consumer.start()
    assert consumer.wait_for(50), f"the consumer did not start: {consumer.problems}"
    started = time.monotonic()
    deleted = Pruner(pg.engine, timedelta(days=7), tables=pg.tables, clock=lambda: t0).run_once()
    ended = time.monotonic()
    consumer.stop()

    assert consumer.problems == []
    assert dict(deleted.deleted) == {"ledger": 1_000_000}
    # What a prune that locks the consumer out looks like: no commit for most of its run.
    # Rates are for bench/bench_pruner.py (a 2-core machine shared with the rest of the
    # suite makes any rate here noise); a stall spanning half the prune is not noise.
    stall = consumer.longest_stall(started, ended)
    print(f"prune {ended - started:.1f} s; the consumer's longest stall {stall:.2f} s")
    assert consumer.processed_between(started, ended) > 0
    assert stall < MAX_STALL_SHARE * (ended - started), (
        f"the consumer committed nothing for {stall:.1f} s of the prune's {ended - started:.1f} s"
    )
    with pg.engine.connect() as conn:
        young = conn.execute(text(f"SELECT count(*) FROM {pe} WHERE message_id LIKE 'young-%'"))
        live = conn.execute(text(f"SELECT count(*) FROM {pe} WHERE message_id LIKE 'live-%'"))
        effects = conn.execute(text(f"SELECT count(*) FROM {ledger}"))
        assert young.scalar() == 10_000
        assert live.scalar() == consumer.total == effects.scalar()


class LiveConsumer:
    """A Deduplicator consumer writing batches of new messages until stopped."""

    def __init__(self, db: Database, ledger: str) -> None:
        dedup = Deduplicator(db.engine, consumer="ledger", tables=db.tables)

        @dedup.handler
        def credit(message: Any, session: Any) -> None:
            session.execute(text(f"INSERT INTO {ledger} VALUES ('a', 1, :id)"), {"id": message.id})

        self.handler = credit
        self.total = 0
        self.problems: list[object] = []
        self.batches: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._progress = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive()

    def wait_for(self, count: int, timeout: float = 30) -> bool:
        with self._progress:
            return self._progress.wait_for(lambda: self.total >= count, timeout)

    def processed_between(self, start: float, end: float) -> int:
        return sum(n for at, n in self.batches if start <= at <= end)

    def longest_stall(self, start: float, end: float) -> float:
        """The longest time within [start, end] with no batch committed."""
        marks = [start, *(at for at, _ in self.batches if start < at < end), end]
        return max(later - earlier for earlier, later in pairwise(marks))

    def _run(self) -> None:
        while not self._stop.is_set():
            batch = [Message(id=f"live-{self.total + i}", body=b"{}") for i in range(10)]
            try:
                results = self.handler.process_batch(batch)
            except Exception as exc:  # told to the test, which asserts there were none
                self.problems.append(exc)
                return
            self.problems += [r for r in results if r.outcome is not Outcome.PROCESSED]
            with self._progress:
                self.total += len(batch)
                self.batches.append((time.monotonic(), len(batch)))
                self._progress.notify_all()


@pytest.mark.slow
@pytest.mark.postgres
def test_dropping_days_under_a_running_consumer_loses_nothing(pg_partitioned: Database) -> None:
    """Drops take an exclusive lock on the table: consumers wait, none fails, no young row goes."""
    from consumerdedup.db.partitions import DayPartitions

    db = pg_partitioned
    pe = db.name("processed_events")
    ledger = db.create_ledger()
    t0 = datetime.now(UTC).replace(microsecond=0)
    first = (t0 - timedelta(days=20)).date()
    with db.engine.begin() as conn:
        assert len(DayPartitions(db.tables.processed_events).ensure(conn, first, 11)) == 11
        conn.execute(
            text(
                f"INSERT INTO {pe} (consumer, message_id, processed_at, payload_hash, outcome) "
                "SELECT 'ledger', 'old-' || i, CAST(:first AS timestamptz) + (i % 11) * "
                "interval '1 day' + (i / 11) * interval '100 ms', repeat('a', 64), 'processed' "
                "FROM generate_series(0, 219999) AS i"
            ),
            {"first": datetime.combine(first, datetime.min.time(), UTC)},
        )
        conn.execute(  # from exactly the cutoff to a day younger
            text(
                f"INSERT INTO {pe} (consumer, message_id, processed_at, payload_hash, outcome) "
                "SELECT 'ledger', 'young-' || i, :t0 - interval '8 days' + i * interval '8 s', "
                "repeat('a', 64), 'processed' FROM generate_series(0, 9999) AS i"
            ),
            {"t0": t0},
        )

    consumer = LiveConsumer(db, ledger)
    consumer.start()
    assert consumer.wait_for(50), f"the consumer did not start: {consumer.problems}"
    report = Pruner(db.engine, timedelta(days=7), tables=db.tables, clock=lambda: t0).run_once()
    assert consumer.wait_for(consumer.total + 50), "the consumer stalled after the drops"
    consumer.stop()

    assert consumer.problems == []
    assert len(report.partitions) == 11  # every old day ends before the cutoff
    assert dict(report.deleted) == {"ledger": 220_000}
    with db.engine.connect() as conn:
        young = conn.execute(text(f"SELECT count(*) FROM {pe} WHERE message_id LIKE 'young-%'"))
        live = conn.execute(text(f"SELECT count(*) FROM {pe} WHERE message_id LIKE 'live-%'"))
        effects = conn.execute(text(f"SELECT count(*) FROM {ledger}"))
        assert young.scalar() == 10_000
        assert live.scalar() == consumer.total == effects.scalar()
