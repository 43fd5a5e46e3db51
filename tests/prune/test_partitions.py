"""A processed_events range-partitioned by day: install, and a pruner that drops whole days."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from datetime import UTC, date, datetime, time, timedelta
from pathlib import Path

import pytest
from sqlalchemy import create_engine, insert, text

from consumerdedup import ConfigurationError, Deduplicator, Message, Outcome, Tables, install
from consumerdedup.db import locks
from consumerdedup.db.partitions import AHEAD, DayPartitions, today
from consumerdedup.schema import ddl
from tests.conftest import Database
from tests.prune.test_pruner import DAY, NOW, US, add_events, pruner, survivors

pytestmark = pytest.mark.postgres


def partitions(db: Database) -> DayPartitions:
    return DayPartitions(db.tables.processed_events)


def day_names(db: Database) -> set[str]:
    with db.engine.connect() as conn:
        return {p.name for p in partitions(db).ranges(conn)}


def children(db: Database) -> set[str]:
    with db.engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT inhrelid::regclass::text FROM pg_inherits "
                "WHERE inhparent = CAST(:t AS regclass)"
            ),
            {"t": db.tables.processed_events.fullname},
        )
        return {name.split(".")[-1] for (name,) in rows}


def make_days(db: Database, first: date, days: int) -> None:
    with db.engine.begin() as conn:
        assert len(partitions(db).ensure(conn, first, days)) == days


def every_six_hours(consumer: str, days: int) -> list[tuple[str, str, datetime]]:
    return [(consumer, f"{consumer}-{i}", NOW - i * timedelta(hours=6)) for i in range(days * 4)]


def rows_in(db: Database, table: str) -> int:
    return int(str(db.scalar(f"SELECT count(*) FROM {db.schema}.{table}")))


# --- install ---------------------------------------------------------------------------------


def test_install_makes_a_default_partition_and_days_ahead(pg_partitioned: Database) -> None:
    db = pg_partitioned
    names = {partitions(db).name_for(today() + timedelta(days=d)) for d in range(-1, AHEAD + 1)}
    assert children(db) == names | {"processed_events_default"}
    install(db.engine, db.tables)  # again: nothing new, nothing lost
    assert children(db) == names | {"processed_events_default"}
    with db.engine.connect() as conn:
        assert partitions(db).is_partitioned(conn)
        for p in partitions(db).ranges(conn):
            assert p.upper - p.lower == DAY and p.lower.tzinfo is not None


def test_partitioned_needs_postgresql_and_a_partitioned_table(
    sqlite_db: Database, pg: Database
) -> None:
    with pytest.raises(ConfigurationError, match="needs PostgreSQL"):
        install(sqlite_db.engine, Tables.define("seen", "out", partitioned=True))
    with pytest.raises(ConfigurationError, match="needs PostgreSQL"):
        Deduplicator(sqlite_db.engine, "c", tables=Tables.define("s2", "o2", partitioned=True))
    plain = pg.tables.processed_events.fullname
    tables = Tables.define(plain, pg.tables.outbox.fullname, partitioned=True)
    with pytest.raises(ConfigurationError, match="exists and is not partitioned"):
        install(pg.engine, tables)
    with pytest.raises(
        ConfigurationError, match=r"Tables.define\(partitioned\): expected True or False"
    ):
        Tables.define(partitioned="yes")  # type: ignore[arg-type]


def test_ddl_shows_the_partitioning(pg_partitioned: Database) -> None:
    sql = ddl(pg_partitioned.engine, pg_partitioned.tables)
    assert "PARTITION BY RANGE (processed_at)" in sql
    assert "PRIMARY KEY (consumer, message_id, processed_at)" in sql
    assert "PARTITION OF" in sql and "DEFAULT" in sql


def test_a_plain_tables_on_a_partitioned_table_is_a_clear_error(pg_partitioned: Database) -> None:
    db = pg_partitioned
    names = (db.tables.processed_events.fullname, db.tables.outbox.fullname)
    dedup = Deduplicator(db.engine, "c", tables=Tables.define(*names))
    handle = dedup.handler(lambda message, session: None)
    with pytest.raises(ConfigurationError, match="partitioned=True"):
        handle(Message(id="m-1", body=b"{}"))
    assert rows_in(db, "processed_events") == 0


def test_repeatable_read_is_refused_before_anything_is_recorded(pg_partitioned: Database) -> None:
    db = pg_partitioned
    engine = create_engine(db.url, isolation_level="REPEATABLE READ")
    calls: list[str] = []
    dedup = Deduplicator(engine, "c", tables=db.tables)
    handle = dedup.handler(lambda message, session: calls.append(message.id))
    try:
        with pytest.raises(ConfigurationError, match="READ COMMITTED"):
            handle(Message(id="m-1", body=b"{}"))
    finally:
        engine.dispose()
    assert calls == [] and rows_in(db, "processed_events") == 0
    ok = Deduplicator(db.engine, "c", tables=db.tables).handler(lambda m, s: calls.append(m.id))
    assert ok(Message(id="m-1", body=b"{}")) is Outcome.PROCESSED


def test_a_claim_holds_one_lock_per_distinct_key_until_commit(pg_partitioned: Database) -> None:
    db = pg_partitioned
    held: list[int] = []
    space = locks.space_params(locks.CLAIM, db.tables.processed_events)
    claim_locks = (
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
        f"AND CAST(classid AS integer) = {locks.SPACE_SQL}"
    )

    def handler(message: Message, session: object) -> None:
        query = text(f"{claim_locks} AND pid = pg_backend_pid()").bindparams(**space)
        held.append(int(session.execute(query).scalar()))  # type: ignore[attr-defined]

    handle = Deduplicator(db.engine, "c", tables=db.tables).handler(handler)
    ids = ["a", "b", "a", "c"]
    outcomes = handle.batch([Message(id=i, body=b"{}") for i in ids])
    assert outcomes == [Outcome.PROCESSED] * 2 + [Outcome.DUPLICATE, Outcome.PROCESSED]
    assert held == [3, 3, 3]
    with db.engine.connect() as conn:  # released at commit
        assert conn.execute(text(claim_locks), space).scalar() == 0


# --- pruning by dropping days ----------------------------------------------------------------


def test_expired_days_are_dropped_whole_and_the_rest_deleted_exactly(
    pg_partitioned: Database,
) -> None:
    db = pg_partitioned
    make_days(db, (NOW - 20 * DAY).date(), 21)
    cutoff = NOW - 8 * DAY  # 7 days + the default 1-day buffer
    add_events(db, every_six_hours("ledger", 20))
    add_events(
        db,
        [
            ("ledger", "at-cutoff", cutoff),
            ("ledger", "just-older", cutoff - US),
            ("ledger", "in-default", NOW - 40 * DAY),  # before the first day partition
        ],
    )
    expected_gone = {i for _, i, at in every_six_hours("ledger", 20) if at < cutoff}
    expected_gone |= {"just-older", "in-default"}
    before = survivors(db)

    report = pruner(db).run_once()

    assert survivors(db) == before - expected_gone
    assert "at-cutoff" in survivors(db)
    assert dict(report.deleted) == {"ledger": len(expected_gone)}
    dropped_days = {partitions(db).name_for((NOW - d * DAY).date()) for d in range(9, 21)}
    assert set(report.partitions) == dropped_days  # up to the day that ends before the cutoff
    assert not dropped_days & children(db)
    assert partitions(db).name_for((NOW - 8 * DAY).date()) in children(db)  # straddles it


def test_a_longer_window_keeps_the_days_it_still_needs(pg_partitioned: Database) -> None:
    db = pg_partitioned
    make_days(db, (NOW - 20 * DAY).date(), 21)
    add_events(db, every_six_hours("ledger", 20) + every_six_hours("audit", 20))
    audit_cutoff = NOW - 15 * DAY - 1.5 * DAY  # 15 days + 10% buffer
    report = pruner(db, windows={"audit": timedelta(days=15)}).run_once()

    # Only days wholly before audit's cutoff went; ledger's younger expired rows were deleted.
    last_dropped = audit_cutoff.date() - DAY
    assert set(report.partitions) == {
        partitions(db).name_for(d)
        for d in (last_dropped - timedelta(days=k) for k in range(20))
        if d >= (NOW - 20 * DAY).date()
    }
    assert survivors(db, "ledger") == {
        i for _, i, at in every_six_hours("ledger", 20) if at >= NOW - 8 * DAY
    }
    assert survivors(db, "audit") == {
        i for _, i, at in every_six_hours("audit", 20) if at >= audit_cutoff
    }


def test_nothing_is_dropped_when_a_consumer_keeps_forever_or_the_round_is_restricted(
    pg_partitioned: Database,
) -> None:
    db = pg_partitioned
    make_days(db, (NOW - 20 * DAY).date(), 21)
    add_events(db, every_six_hours("ledger", 20) + every_six_hours("archive", 20))
    old_days = day_names(db)

    kept = pruner(db, windows={"archive": None}).run_once()
    assert kept.partitions == ()
    assert survivors(db, "archive") == {i for _, i, _ in every_six_hours("archive", 20)}
    assert survivors(db, "ledger") == {
        i for _, i, at in every_six_hours("ledger", 20) if at >= NOW - 8 * DAY
    }

    add_events(db, [("ledger", "old-again", NOW - 19 * DAY)])
    restricted = pruner(db, consumers=["ledger"]).run_once()
    assert restricted.partitions == () and dict(restricted.deleted) == {"ledger": 1}
    assert old_days <= day_names(db)


def test_dry_run_names_the_days_and_drops_nothing(pg_partitioned: Database) -> None:
    db = pg_partitioned
    make_days(db, (NOW - 20 * DAY).date(), 21)
    add_events(db, every_six_hours("ledger", 20))
    before, days = survivors(db), day_names(db)
    report = pruner(db, dry_run=True).run_once()
    assert report.dry_run and len(report.partitions) == 12
    assert sum(report.deleted.values()) == len(
        [1 for _, _, at in every_six_hours("ledger", 20) if at < NOW - 8 * DAY]
    )
    assert survivors(db) == before and day_names(db) == days


def test_each_round_makes_the_days_ahead_of_its_clock(pg_partitioned: Database) -> None:
    db = pg_partitioned
    pruner(db).run_once()
    expected = {
        partitions(db).name_for(NOW.date() + timedelta(days=d)) for d in range(-1, AHEAD + 1)
    }
    assert expected <= day_names(db)
    new = Deduplicator(db.engine, "c", tables=db.tables).handler(lambda m, s: None)
    assert new(Message(id="today", body=b"{}")) is Outcome.PROCESSED
    assert rows_in(db, "processed_events_default") == 0  # today has its own partition


def test_a_day_whose_rows_sit_in_default_is_skipped_with_a_warning(
    pg_partitioned: Database, caplog: pytest.LogCaptureFixture
) -> None:
    db = pg_partitioned
    stray = NOW - 3 * DAY
    add_events(db, [("ledger", "stray", stray)])  # no partition for that day yet: DEFAULT
    with caplog.at_level(logging.WARNING, "consumerdedup.partitions"), db.engine.begin() as conn:
        made = partitions(db).ensure(conn, stray.date() - DAY, 3)
    skipped = partitions(db).name_for(stray.date())
    assert skipped not in made and len(made) == 2
    assert any(skipped in r.getMessage() for r in caplog.records)
    assert rows_in(db, "processed_events_default") == 1
    pruner(db, timedelta(days=1)).run_once()  # deleted row by row instead
    assert survivors(db) == set()


def test_a_drop_that_cannot_get_its_lock_is_skipped_and_its_rows_deleted(
    pg_partitioned: Database,
) -> None:
    db = pg_partitioned
    make_days(db, (NOW - 20 * DAY).date(), 3)
    add_events(db, every_six_hours("ledger", 20))
    busy = partitions(db).name_for((NOW - 20 * DAY).date())
    with db.engine.connect() as reader:  # a long reader holds the partition: no drop in time
        reader.execute(text(f"SELECT count(*) FROM {db.schema}.{busy}"))
        report = pruner(db).run_once()
        reader.rollback()
    assert busy not in report.partitions and busy in children(db)
    assert len(report.partitions) == 2
    assert survivors(db) == {i for _, i, at in every_six_hours("ledger", 20) if at >= NOW - 8 * DAY}
    assert rows_in(db, busy) == 0


def test_cli_init_db_partitioned_and_prune_reports_the_days(
    pg_partitioned: Database, tmp_path: Path
) -> None:
    db = pg_partitioned
    schema = f"{db.schema}_cli"
    cli = [sys.executable, "-m", "consumerdedup"]
    names = ["--processed-events-table", f"{schema}.pe", "--outbox-table", f"{schema}.ob"]
    try:
        done = subprocess.run(
            [*cli, "init-db", "--db", db.url, *names, "--partitioned"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        tables = Tables.define(f"{schema}.pe", f"{schema}.ob", partitioned=True)
        with db.engine.begin() as conn:
            DayPartitions(tables.processed_events).ensure(conn, today() - 30 * DAY, 3)
            conn.execute(
                insert(tables.processed_events),
                [
                    {
                        "consumer": "c",
                        "message_id": f"m{i}",
                        "processed_at": datetime.combine(
                            today() - (29 - i % 2) * DAY, time.min, UTC
                        ),
                        "payload_hash": "0" * 64,
                        "outcome": "processed",
                    }
                    for i in range(10)
                ],
            )
        done = subprocess.run(
            [*cli, "prune", "--db", db.url, *names, "--retention", "7d"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert "deleted 10 rows" in done.stdout
        assert "3 partitions whole" in done.stdout, done.stdout  # one of them empty
        again = subprocess.run(
            [*cli, "init-db", "--db", f"sqlite:///{tmp_path / 'x.db'}", "--partitioned"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert again.returncode != 0 and "needs PostgreSQL" in again.stderr
        sql = subprocess.run(
            [*cli, "init-db", "--db", f"sqlite:///{tmp_path / 'x.db'}", "--partitioned", "--sql"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert sql.returncode == 1 and "needs PostgreSQL" in sql.stderr and not sql.stdout
    finally:
        with db.engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))


def test_batch_deletes_across_partitions_miss_no_row(pg_partitioned: Database) -> None:
    """A ctid names one row in each partition; a batch must not skip rows because of it."""
    db = pg_partitioned
    make_days(db, (NOW - 20 * DAY).date(), 2)
    older = [("ledger", f"old-{i}", NOW - 20 * DAY + i * US) for i in range(20)]
    newer = [("ledger", f"new-{i}", NOW - 19 * DAY + i * US) for i in range(5)]
    add_events(db, older + newer)  # ctids (0,1) to (0,5) in both day partitions
    report = pruner(db, consumers=["ledger"], batch_size=5).run_once()  # no drops: rows only
    assert report.partitions == ()
    assert dict(report.deleted) == {"ledger": 25}
    assert survivors(db) == set()


def test_a_partitioned_table_without_partitions_is_a_clear_error(pg_partitioned: Database) -> None:
    """Created by a migration tool from the metadata alone: no DEFAULT, no days."""
    db = pg_partitioned
    with db.engine.begin() as conn:
        for name in children(db):
            conn.execute(text(f"DROP TABLE {db.schema}.{name}"))
    handle = Deduplicator(db.engine, "c", tables=db.tables).handler(lambda m, s: None)
    with pytest.raises(ConfigurationError, match="no partition"):
        handle(Message(id="m-1", body=b"{}"))
    install(db.engine, db.tables)
    assert handle(Message(id="m-1", body=b"{}")) is Outcome.PROCESSED


def test_stats_shows_the_days_and_what_fell_into_default(pg_partitioned: Database) -> None:
    db = pg_partitioned
    add_events(db, [("ledger", "stray", NOW - 300 * DAY)])  # long before any day partition
    names = ["--processed-events-table", db.tables.processed_events.fullname]
    names += ["--outbox-table", db.tables.outbox.fullname]
    cli = [sys.executable, "-m", "consumerdedup", "--db", db.url, *names]
    done = subprocess.run([*cli, "stats"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"partitioned by day: {AHEAD + 2} partitions" in done.stdout
    assert "1 rows in DEFAULT (days not made in time" in done.stdout
    done = subprocess.run([*cli, "stats", "--json"], capture_output=True, text=True, timeout=60)
    days = json.loads(done.stdout)["processed_events"]["partitioned"]
    assert days["partitions"] == AHEAD + 2 and days["rows_in_default"] == 1
    first = today() - DAY
    assert datetime.fromisoformat(days["oldest_from"]) == datetime.combine(first, time.min, UTC)


def test_install_in_your_transaction_leaves_its_settings_alone(pg: Database) -> None:
    tables = Tables.define(f"{pg.schema}.by_day", f"{pg.schema}.by_day_out", partitioned=True)
    settings = "SELECT current_setting('lock_timeout'), current_setting('statement_timeout'), "
    settings += "current_setting('TimeZone')"
    with pg.engine.begin() as conn:
        conn.execute(text("SET LOCAL lock_timeout = '7s'"))
        conn.execute(text("SET LOCAL TimeZone = 'Asia/Tokyo'"))
        before = conn.execute(text(settings)).one()
        install(conn, tables)
        assert conn.execute(text(settings)).one() == before == ("7s", "0", "Asia/Tokyo")
    with pg.engine.connect() as conn:  # and the bounds read right in any time zone
        conn.execute(text("SET TimeZone = 'America/Los_Angeles'"))
        days = DayPartitions(tables.processed_events).ranges(conn)
        assert [d.lower.date() for d in days] == [today() + timedelta(days=k) for k in range(-1, 8)]
        assert all(d.lower.utcoffset() == timedelta(0) and d.lower.hour == 0 for d in days)
