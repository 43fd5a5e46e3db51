"""Pruning a million expired rows on PostgreSQL while a consumer keeps processing."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import event, text

from consumerdedup import Deduplicator, Message, Outcome, Pruner
from tests.conftest import Database

HOLD_EVERY = 10
"""The prune holds every tenth batch's transaction open (its rows deleted, not committed)
until the consumer beside it has committed a batch begun inside it: 21 holds in 201
batches, each a point where a pruner that locked the consumer out could not go on."""


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
    # Not a share of time (on 2 loaded cores any rate is noise; rates are for
    # bench/bench_pruner.py) but the property itself, by construction: inside the prune's
    # batch transactions, right after their DELETE, with every lock the batch takes held,
    # the consumer begins and commits a batch. A prune that locked the consumer out (a
    # table lock, a claim's key) would leave it waiting there, seen in pg_stat_activity.
    pruner_thread = threading.current_thread()
    table = pg.tables.processed_events.name
    holds: list[int] = []  # per hold: how many messages the consumer committed inside it
    waits: list[Any] = []  # if it did not: the sessions then waiting on a lock of the test
    deletes = 0

    def hold(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        nonlocal deletes
        if threading.current_thread() is not pruner_thread or "DELETE FROM" not in statement:
            return
        if table not in statement:  # the outbox's and the keys' batches: not these
            return
        deletes += 1
        if (deletes - 1) % HOLD_EVERY or (holds and holds[-1] < 20):  # none after a failure
            return
        before = consumer.total
        # Two batches: the one in flight, then one begun and committed inside the hold.
        if not consumer.wait_for(before + 20, timeout=60):
            waits.extend(lock_waits(pg, (table, ledger)))
        holds.append(consumer.total - before)

    event.listen(pg.engine, "after_cursor_execute", hold)
    try:
        pruner = Pruner(pg.engine, timedelta(days=7), tables=pg.tables, clock=lambda: t0)
        deleted = pruner.run_once()
    finally:
        event.remove(pg.engine, "after_cursor_execute", hold)
    consumer.stop()

    assert consumer.problems == []
    assert dict(deleted.deleted) == {"ledger": 1_000_000}
    print(f"the consumer committed inside each of {len(holds)} held batches: {holds}")
    assert all(n >= 20 for n in holds), f"the consumer waited on the prune: {holds} {waits}"
    # 200 full batches and the empty one that ends the round: held at 1, 11, ..., 201.
    assert (deletes, len(holds)) == (201, 21)
    with pg.engine.connect() as conn:
        young = conn.execute(text(f"SELECT count(*) FROM {pe} WHERE message_id LIKE 'young-%'"))
        live = conn.execute(text(f"SELECT count(*) FROM {pe} WHERE message_id LIKE 'live-%'"))
        effects = conn.execute(text(f"SELECT count(*) FROM {ledger}"))
        assert young.scalar() == 10_000
        assert live.scalar() == consumer.total == effects.scalar()


def lock_waits(db: Database, names: tuple[str, ...]) -> list[Any]:
    """The sessions waiting on a lock whose statement names one of ``names``."""
    with db.engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT pid, wait_event, query FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            )
        ).all()
    return [row for row in rows if any(name in row.query for name in names)]


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
