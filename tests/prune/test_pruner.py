"""Pruner against real SQLite, PostgreSQL and MariaDB: what goes, what stays, and who may
prune."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, insert, select, text

from consumerdedup import ConfigurationError, Pruner
from consumerdedup.prune.report import PruneProgress, PruneReport
from consumerdedup.prune.statements import PruneStatements
from consumerdedup.prune.windows import UnknownConsumer
from tests.conftest import Database, database
from tests.core.test_lifecycle import MARGIN, NOTICED

NOW = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
DAY = timedelta(days=1)
US = timedelta(microseconds=1)


@pytest.fixture(params=["sqlite", "postgresql", "mariadb"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    yield from database(request, request.param, tmp_path)


def clock() -> datetime:
    return NOW


def add_events(db: Database, rows: Iterable[tuple[str, str, datetime]]) -> None:
    values = [
        {
            "consumer": consumer,
            "message_id": message_id,
            "processed_at": at,
            "payload_hash": "0" * 64,
            "outcome": "processed",
        }
        for consumer, message_id, at in rows
    ]
    with db.engine.begin() as conn:
        conn.execute(insert(db.tables.processed_events), values)


def survivors(db: Database, consumer: str | None = None) -> set[str]:
    pe = db.tables.processed_events
    query = select(pe.c.message_id)
    if consumer is not None:
        query = query.where(pe.c.consumer == consumer)
    with db.engine.connect() as conn:
        return set(conn.execute(query).scalars())


def pruner(db: Database, retention: timedelta | None = timedelta(days=7), **options: Any) -> Pruner:
    options.setdefault("tables", db.tables)
    options.setdefault("clock", clock)
    return Pruner(db.engine, retention, **options)


# --- the rule: older than retention + buffer goes, the rest stays -------------------------------


def test_the_exact_cutoff_is_kept_and_a_microsecond_older_goes(db: Database) -> None:
    cutoff = NOW - timedelta(days=7) - DAY  # the default buffer of a 7-day retention: 1 day
    add_events(
        db,
        [
            ("c", "older", cutoff - US),
            ("c", "at-cutoff", cutoff),
            ("c", "younger", cutoff + US),
            ("c", "fresh", NOW),
        ],
    )
    assert pruner(db).prune() == 1
    assert survivors(db) == {"at-cutoff", "younger", "fresh"}


def test_default_buffer_is_one_day_or_ten_percent(db: Database) -> None:
    assert pruner(db, timedelta(days=2)).config.keep.others == timedelta(days=3)
    assert pruner(db, timedelta(days=30)).config.keep.others == timedelta(days=33)
    hour = pruner(db, timedelta(days=30), buffer=timedelta(hours=1))
    assert hour.config.keep.others == timedelta(days=30, hours=1)
    add_events(db, [("c", "32d", NOW - 32 * DAY), ("c", "34d", NOW - 34 * DAY)])
    assert pruner(db, timedelta(days=30)).prune() == 1
    assert survivors(db) == {"32d"}


def test_each_consumer_keeps_its_own_window(db: Database) -> None:
    # Every 6 hours over 60 days, plus 40 rows sharing one timestamp (more than a batch).
    consumers = ("ledger", "audit", "mail", "billing")
    rows = [(c, f"{c}-{i}", timedelta(hours=6 * i)) for c in consumers for i in range(240)]
    rows += [(c, f"{c}-tie-{i}", 20 * DAY) for c in consumers for i in range(40)]
    add_events(db, [(c, message_id, NOW - age) for c, message_id, age in rows])
    windows = {"audit": timedelta(days=30), "mail": None, "billing": timedelta(days=2)}
    keep = {"ledger": 8 * DAY, "audit": 33 * DAY, "mail": timedelta.max, "billing": 3 * DAY}

    report = pruner(db, timedelta(days=7), windows=windows, batch_size=7).run_once()

    for consumer in consumers:
        expected = {m for c, m, age in rows if c == consumer and age <= keep[consumer]}
        assert survivors(db, consumer) == expected, consumer
    gone = {c: sum(1 for r in rows if r[0] == c and r[2] > keep[c]) for c in consumers}
    assert {c: report.deleted[c] for c in consumers} == gone
    assert gone["ledger"] == 207 + 40 and gone["mail"] == 0
    assert report.cutoffs == {
        "audit": NOW - 33 * DAY,
        "billing": NOW - 3 * DAY,
        "mail": None,
        "*": NOW - 8 * DAY,
    }


def test_consumers_restricts_the_round(db: Database) -> None:
    old = NOW - 100 * DAY
    add_events(db, [("ledger", "l", old), ("audit", "a", old), ("mail", "m", old)])
    report = pruner(db, consumers=["ledger"], windows={"audit": timedelta(days=1)}).run_once()
    assert dict(report.deleted) == {"ledger": 1}
    assert survivors(db) == {"a", "m"}


def test_retention_none_prunes_only_the_consumers_with_windows(db: Database) -> None:
    old = NOW - 100 * DAY
    add_events(db, [("ledger", "l", old), ("audit", "a", old)])
    assert pruner(db, None, windows={"audit": timedelta(days=1)}).prune() == 1
    assert survivors(db) == {"l"}


# --- the outbox ---------------------------------------------------------------------------------


def add_outbox(db: Database, event_id: str, published: datetime | None, attempts: int = 0) -> None:
    created = NOW - 60 * DAY
    with db.engine.begin() as conn:
        conn.execute(
            insert(db.tables.outbox).values(
                event_id=event_id,
                destination="out",
                body=b"{}",
                headers={},
                created_at=created,
                available_at=created,
                attempts=attempts,
                published_at=published,
            )
        )


def outbox_ids(db: Database) -> set[str]:
    with db.engine.connect() as conn:
        return set(conn.execute(select(db.tables.outbox.c.event_id)).scalars())


def test_only_published_outbox_rows_past_their_window_go(db: Database) -> None:
    add_outbox(db, "published-old", NOW - 8 * DAY)
    add_outbox(db, "published-at-window", NOW - 7 * DAY)
    add_outbox(db, "published-new", NOW - DAY)
    add_outbox(db, "unpublished-old", None)
    add_outbox(db, "parked-old", None, attempts=50)

    report = pruner(db).run_once()

    assert report.outbox == 1
    assert outbox_ids(db) == {
        "published-at-window",
        "published-new",
        "unpublished-old",
        "parked-old",
    }
    assert pruner(db, outbox_keep=timedelta(seconds=1), batch_size=1).run_once().outbox == 2
    assert outbox_ids(db) == {"unpublished-old", "parked-old"}


def test_outbox_keep_none_leaves_the_outbox_alone(db: Database) -> None:
    add_outbox(db, "published-old", NOW - 80 * DAY)
    assert pruner(db, outbox_keep=None).run_once().outbox == 0
    assert outbox_ids(db) == {"published-old"}


# --- dry run, progress, stop --------------------------------------------------------------------


def test_dry_run_counts_and_deletes_nothing(db: Database) -> None:
    add_events(db, [("a", f"a{i}", NOW - i * DAY) for i in range(20)])
    add_events(db, [("b", f"b{i}", NOW - i * DAY) for i in range(20)])
    add_outbox(db, "old", NOW - 30 * DAY)
    windows = {"b": timedelta(days=3)}

    dry = pruner(db, windows=windows, dry_run=True).run_once()

    assert dry.dry_run
    assert dict(dry.deleted) == {"a": 11, "b": 15} and dry.outbox == 1
    assert len(survivors(db)) == 40 and outbox_ids(db) == {"old"}
    real = pruner(db, windows=windows).run_once()
    assert dict(real.deleted) == dict(dry.deleted) and real.outbox == dry.outbox


def test_progress_is_told_after_every_batch_and_cannot_break_the_round(db: Database) -> None:
    add_events(db, [("c", f"m{i}", NOW - 30 * DAY - i * US) for i in range(95)])
    seen: list[PruneProgress] = []

    def progress(update: PruneProgress) -> None:
        seen.append(update)
        raise RuntimeError("a broken progress bar")

    assert pruner(db, batch_size=10, progress=progress, outbox_keep=None).prune() == 95
    assert [p.deleted for p in seen] == [10, 20, 30, 40, 50, 60, 70, 80, 90, 95]
    assert {p.table for p in seen} == {db.tables.processed_events.fullname}


def test_stop_ends_the_round_after_the_batch_in_flight(db: Database) -> None:
    add_events(db, [("c", f"m{i}", NOW - 30 * DAY - i * US) for i in range(50)])
    p = pruner(db, batch_size=10)
    p.progress = lambda update: p.stop()

    report = p.run_once()

    assert report.stopped and report.total == 10
    assert len(survivors(db)) == 40
    if db.dialect == "postgresql":  # the lock went with the round
        assert not pruner(db).run_once().skipped


def test_stop_wakes_a_pruner_pausing_between_batches(db: Database) -> None:
    add_events(db, [("c", f"m{i}", NOW - 30 * DAY - i * US) for i in range(50)])
    p = pruner(db, batch_size=10, batch_pause=timedelta(hours=1))
    first = threading.Event()
    p.progress = lambda update: first.set()
    reports: list[PruneReport] = []
    worker = threading.Thread(target=lambda: reports.append(p.run_once()))
    worker.start()
    assert first.wait(30)
    started = time.monotonic()
    p.stop()
    worker.join(30)
    assert not worker.is_alive() and time.monotonic() - started < NOTICED + MARGIN
    assert reports[0].stopped and reports[0].total == 10


def test_run_every_prunes_then_stops_on_request(db: Database) -> None:
    add_events(db, [("c", f"m{i}", NOW - 30 * DAY) for i in range(5)])
    p = pruner(db)
    reports: list[PruneReport] = []
    first = threading.Event()

    def on_report(report: PruneReport) -> None:
        reports.append(report)
        first.set()

    totals: list[int] = []
    worker = threading.Thread(
        target=lambda: totals.append(p.run(timedelta(hours=1), on_report=on_report))
    )
    worker.start()
    assert first.wait(30)
    started = time.monotonic()
    p.stop()
    worker.join(30)
    assert not worker.is_alive() and time.monotonic() - started < NOTICED + MARGIN
    assert totals == [5] and len(reports) == 1


# --- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"retention": timedelta(days=-1)}, r"PrunerConfig.retention: expected a timedelta > 0"),
        ({"retention": timedelta(0)}, r"PrunerConfig.retention: expected a timedelta > 0"),
        ({"retention": timedelta.max}, "pass None to keep records forever"),
        ({"retention": 7}, r"or None to keep records forever, got 7 \(int\)"),
        ({"buffer": timedelta(0)}, r"PrunerConfig.buffer: expected a timedelta > 0"),
        ({"buffer": timedelta(hours=-1)}, r"PrunerConfig.buffer: expected a timedelta > 0"),
        ({"windows": {"a": timedelta(days=-2)}}, r"PrunerConfig.windows\['a'\]: expected"),
        ({"windows": {"": DAY}}, "PrunerConfig.windows key: expected a non-empty string"),
        ({"consumers": ["ok", ""]}, r"PrunerConfig.consumers\[1\]: expected a non-empty string"),
        ({"batch_size": 0}, "batch_size"),
        ({"batch_pause": timedelta(seconds=-1)}, "batch_pause"),
        ({"outbox_keep": timedelta(0)}, "PrunerConfig.outbox_keep: expected a timedelta > 0"),
    ],
)
def test_bad_settings_are_configuration_errors(options: dict[str, Any], message: str) -> None:
    engine = create_engine("sqlite://")
    options = {"retention": timedelta(days=7), **options}
    with pytest.raises(ConfigurationError, match=message) as caught:
        Pruner(engine, **options)
    assert isinstance(caught.value, ValueError)


def test_a_naive_clock_is_refused(db: Database) -> None:
    with pytest.raises(ConfigurationError, match="timezone-aware"):
        pruner(db, clock=lambda: datetime(2025, 1, 1)).prune()


def test_every_must_be_positive(db: Database) -> None:
    with pytest.raises(ConfigurationError, match="every: expected a timedelta > 0"):
        pruner(db).run(timedelta(0))


def test_unknown_consumers_are_named_with_the_known_ones(db: Database) -> None:
    add_events(db, [("ledger", "1", NOW - 100 * DAY), ("mail", "2", NOW - 100 * DAY)])
    with pytest.raises(UnknownConsumer, match=r"'ledgr'.*consumers with records: ledger, mail"):
        pruner(db, consumers=["ledgr", "mail"]).check_consumers()
    with pytest.raises(UnknownConsumer, match="'audit'"):
        pruner(db, windows={"audit": timedelta(days=90)}).check_consumers()
    pruner(db, consumers=["ledger"]).check_consumers()
    # prune() itself is not fussy: a consumer whose records all expired is nothing to prune.
    assert pruner(db, consumers=["ledgr"]).prune() == 0
    assert survivors(db) == {"1", "2"}


# --- one pruner at a time -----------------------------------------------------------------------


@pytest.mark.postgres
def test_a_second_pruner_skips_the_round_while_the_first_holds_the_lock(pg: Database) -> None:
    add_events(pg, [("c", f"m{i}", NOW - 30 * DAY - i * US) for i in range(100)])
    first = pruner(pg, batch_size=10)
    second = pruner(pg, batch_size=10)
    during: list[PruneReport] = []

    def meanwhile(update: PruneProgress) -> None:
        if not during:  # a whole round of the other pruner, in another thread, mid-round
            worker = threading.Thread(target=lambda: during.append(second.run_once()))
            worker.start()
            worker.join(30)

    first.progress = meanwhile
    assert first.prune() == 100
    assert during[0].skipped and during[0].total == 0
    assert survivors(pg) == set()
    add_events(pg, [("c", "later", NOW - 30 * DAY)])
    assert second.prune() == 1  # the lock was released with the round


@pytest.mark.postgres
def test_racing_pruners_delete_every_row_once(pg: Database) -> None:
    add_events(pg, [("c", f"m{i}", NOW - 30 * DAY - i * US) for i in range(3000)])
    barrier = threading.Barrier(4)
    reports: list[PruneReport] = []

    def race() -> None:
        p = pruner(pg, batch_size=100)
        barrier.wait()
        reports.append(p.run_once())

    workers = [threading.Thread(target=race) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert sum(r.total for r in reports) == 3000
    assert len([r for r in reports if r.total > 0]) == 1
    assert survivors(pg) == set()


@pytest.mark.postgres
def test_the_lock_is_released_when_a_round_fails(pg: Database) -> None:
    add_events(pg, [("c", "m", NOW - 30 * DAY)])
    with pg.engine.begin() as conn:
        conn.execute(text(f"DROP TABLE {pg.name('outbox')} CASCADE"))
    with pytest.raises(Exception, match="outbox"):
        pruner(pg).run_once()
    with pg.engine.connect() as conn:
        taken = PruneStatements(pg.tables, "postgresql", [], True).try_lock(conn)
        conn.execute(text("SELECT pg_advisory_unlock_all()"))
    assert taken is True
    assert survivors(pg) == set()  # the processed_events batches had committed


@pytest.fixture(params=["sqlite", "mariadb"])
def lockless(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """The databases where pruners take no lock for the round."""
    yield from database(request, request.param, tmp_path)


def test_pruners_without_a_lock_side_by_side_delete_every_row_once(lockless: Database) -> None:
    """No lock on SQLite (the write lock serializes the batches) nor on MariaDB (each batch
    row-locks what it deletes): the counts still add up, every row deleted once."""
    db = lockless
    add_events(db, [("c", f"m{i}", NOW - 30 * DAY - i * US) for i in range(2000)])
    totals: list[int] = []
    barrier = threading.Barrier(3)

    def race() -> None:
        one = pruner(db, batch_size=50)
        barrier.wait()
        totals.append(one.prune())

    workers = [threading.Thread(target=race) for _ in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert sum(totals) == 2000
    assert survivors(db) == set()
