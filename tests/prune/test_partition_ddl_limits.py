"""Making a day never holds consumers up for long (README, "Partitioned processed_events"):
the DDL waits at most 500 ms for its lock, its scan of DEFAULT runs at most 2 s, and a day not
made is tried again next round, while the round itself goes on.

Each test drops one of the days ``install`` made and runs pruner rounds on the clock of that
install, so a round has exactly that one day to make.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import pytest
from sqlalchemy import text

from consumerdedup import Deduplicator, Message, Outcome, Pruner
from consumerdedup.db import partitions as partitions_module
from consumerdedup.db.partitions import DAY, RangePartition
from tests.conftest import Database
from tests.prune.test_partitions import day_names, partitions, rows_in

pytestmark = pytest.mark.postgres

DEADLINE = 10.0
"""Seconds after which a round that never returns fails the test instead of hanging it."""


def drop_the_last_day(db: Database) -> tuple[RangePartition, Pruner]:
    """Drop the last day install made; a pruner whose rounds want the same days as install."""
    with db.engine.connect() as conn:
        days = partitions(db).ranges(conn)
    with db.engine.begin() as conn:
        conn.execute(text(f"DROP TABLE {db.schema}.{days[-1].name}"))
    now = days[0].lower + DAY + timedelta(hours=12)  # install's clock: its days start yesterday
    pruner = Pruner(db.engine, timedelta(days=7), tables=db.tables, clock=lambda: now)
    return days[-1], pruner


def not_made(caplog: pytest.LogCaptureFixture, day: RangePartition) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "consumerdedup.partitions" and day.name in r.getMessage()
    ]


def test_the_readme_limits() -> None:
    assert partitions_module.LOCK_TIMEOUT == "500ms"
    assert partitions_module.SCAN_TIMEOUT == "2s"


def test_a_day_waits_at_most_500ms_for_its_lock_and_is_made_next_round(
    pg_partitioned: Database, caplog: pytest.LogCaptureFixture
) -> None:
    db = pg_partitioned
    missing, pruner = drop_the_last_day(db)
    caplog.set_level(logging.WARNING, "consumerdedup.partitions")
    waiting_ddl = text(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND query LIKE 'CREATE TABLE%' AND position(:schema IN query) > 0"
    )
    handle = Deduplicator(db.engine, "ledger", tables=db.tables).handler(lambda m, s: None)
    rounds: list[object] = []
    with db.engine.connect() as reader, db.engine.connect() as watcher:
        # An open transaction that read the table holds ACCESS SHARE on it until it ends,
        # which CREATE TABLE ... PARTITION OF (ACCESS EXCLUSIVE on the table) must wait for.
        reader.execute(text(f"SELECT count(*) FROM {db.schema}.processed_events"))
        try:

            def round_() -> None:
                started = time.monotonic()
                try:
                    rounds.append(pruner.run_once())
                except BaseException as exc:  # reported below, not lost in the thread
                    rounds.append(exc)
                rounds.append(time.monotonic() - started)

            thread = threading.Thread(target=round_, daemon=True)
            thread.start()
            deadline = time.monotonic() + DEADLINE
            while not watcher.execute(waiting_ddl, {"schema": db.schema}).scalar_one():
                watcher.rollback()  # pg_stat_activity is read once per transaction
                assert time.monotonic() < deadline, "the round never waited for its lock"
                time.sleep(0.005)
            # A consumer arriving now queues behind the DDL's lock request, not for long.
            started = time.monotonic()
            assert handle(Message(id="while-ddl-waits", body=b"{}")) is Outcome.PROCESSED
            consumer_waited = time.monotonic() - started
            thread.join(DEADLINE)
        finally:
            reader.rollback()
    assert not thread.is_alive(), "the round waited for its lock without limit"
    report, elapsed = rounds
    assert not isinstance(report, BaseException), f"the round failed: {report!r}"
    assert not report.skipped  # type: ignore[attr-defined]
    # What ended the DDL's wait is read from its error, not from a clock: "lock timeout"
    # (500 ms), not the 2 s statement_timeout nor the reader letting go (it still held its
    # lock when the consumer finished, so the consumer queued behind a DDL that gave up).
    # The clock only says the wait was not cut short; the upper bounds are hang guards (a
    # bound of 1.5 s was a wall-clock assertion that a loaded 2-core machine could break).
    warnings = not_made(caplog, missing)
    assert len(warnings) == 1 and "lock timeout" in warnings[0], warnings
    assert 0.45 <= elapsed < DEADLINE, elapsed  # type: ignore[operator]
    assert consumer_waited < DEADLINE, consumer_waited
    assert missing.name not in day_names(db)

    pruner.run_once()  # nothing in the way now: the next round makes the day
    assert missing.name in day_names(db)


def test_a_day_whose_default_scan_runs_too_long_is_made_next_round(
    pg_partitioned: Database, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scan limit is lowered for the first round (10 ms instead of 2 s): a DEFAULT slow
    enough to scan for 2 s needs tens of millions of rows. 300,000 rows (about 1.5 s to
    insert) take some 40 ms to scan here, four times the lowered limit, and far less than
    the real one, under which the next round makes the day with the rows still there."""
    db = pg_partitioned
    missing, pruner = drop_the_last_day(db)
    with db.engine.begin() as conn:  # far in the future: in DEFAULT, and kept by the pruner
        conn.execute(
            text(
                f"INSERT INTO {db.schema}.processed_events "
                "(consumer, message_id, processed_at, payload_hash, outcome) "
                "SELECT 'ledger', 'm' || g, TIMESTAMPTZ '2100-01-01' + g * INTERVAL '1 second', "
                "repeat('0', 64), 'processed' FROM generate_series(1, 300000) AS g"
            )
        )
    assert rows_in(db, "processed_events_default") == 300_000
    caplog.set_level(logging.WARNING, "consumerdedup.partitions")
    monkeypatch.setattr(partitions_module, "SCAN_TIMEOUT", "10ms")

    report = pruner.run_once()  # the round goes on without the day
    assert not report.skipped
    assert missing.name not in day_names(db)
    warnings = not_made(caplog, missing)
    assert len(warnings) == 1 and "statement timeout" in warnings[0], warnings
    assert rows_in(db, "processed_events_default") == 300_000

    monkeypatch.undo()  # the real limit, 2 s: the scan fits in it
    pruner.run_once()
    assert missing.name in day_names(db), not_made(caplog, missing)
