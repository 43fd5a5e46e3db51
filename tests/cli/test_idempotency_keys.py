"""``consumerdedup prune --idempotency-keep`` and ``stats`` on the HTTP idempotency keys.

Run for real in a subprocess on SQLite and PostgreSQL, over records the SQL store wrote at
chosen times (the command's clock is the real one, so the times are relative to now).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select

from consumerdedup.http.sql_store import SqlStore
from consumerdedup.http.store import Claimed
from consumerdedup.http.stored import StoredResponse
from tests.cli.test_commands import Run, cli
from tests.conftest import Database

HOUR = timedelta(hours=1)
DAY = timedelta(days=1)
SCOPE = "POST /payments"


def options(db: Database) -> list[str]:
    tables = ["--processed-events-table", db.tables.processed_events.fullname]
    return ["--db", db.url, *tables, "--outbox-table", db.tables.outbox.fullname]


def fill(db: Database) -> None:
    now = datetime.now(UTC)

    def store(ago: timedelta) -> SqlStore:
        return SqlStore(db.engine, db.tables, clock=lambda: now - ago)

    def completed(key: str, ago: timedelta, expiry: timedelta, kept: bool = True) -> None:
        claimed = store(ago).claim(SCOPE, key, "fp", timedelta(minutes=1))
        assert isinstance(claimed, Claimed)
        response = StoredResponse(201, (), b"{}") if kept else StoredResponse.unreplayable(200)
        assert store(ago).complete(SCOPE, key, claimed.token, response, expiry)

    completed("expired", 2 * DAY, DAY)
    completed("expired-not-stored", 2 * DAY, DAY, kept=False)
    completed("live", 3 * HOUR, DAY)
    assert isinstance(store(HOUR).claim(SCOPE, "running", "fp", DAY), Claimed)
    assert isinstance(store(2 * DAY).claim(SCOPE, "abandoned", "fp", HOUR), Claimed)


def keys(db: Database) -> set[str]:
    table = db.tables.idempotency_keys
    with db.engine.connect() as conn:
        return set(conn.execute(select(table.c.key)).scalars())


def prune(db: Database, *args: str) -> Run:
    run = cli("prune", *options(db), "--retention", "7d", *args)
    return run


def test_prune_deletes_the_keys_past_their_stored_expiry(db: Database) -> None:
    fill(db)
    run = prune(db)
    assert run.code == 0, run.err
    assert "idempotency keys past their stored expiry" in run.out
    assert f"3 expired keys from {db.tables.idempotency_keys.fullname}" in run.out, run.out
    assert keys(db) == {"live", "running"}


def test_prune_with_a_keep_deletes_older_keys_but_not_a_held_claim(db: Database) -> None:
    fill(db)
    run = prune(db, "--idempotency-keep", "2h")
    assert run.code == 0, run.err
    assert "or older than 2h" in run.out and "4 expired keys" in run.out, run.out
    assert keys(db) == {"running"}


def test_prune_dry_run_and_off_leave_every_key(db: Database) -> None:
    fill(db)
    dry = prune(db, "--dry-run")
    assert dry.code == 0 and "would delete" in dry.out and "3 expired keys" in dry.out, dry.out
    off = prune(db, "--idempotency-keep", "off")
    assert off.code == 0 and "idempotency keys left alone" in off.out, off.out
    assert "0 expired keys" in off.out
    assert len(keys(db)) == 5


@pytest.mark.parametrize(
    ("value", "fragment"),
    [("forever", "'off' leaves them all"), ("-1h", "--idempotency-keep"), ("soon", "soon")],
)
def test_a_bad_keep_is_a_usage_error_and_deletes_nothing(
    db: Database, value: str, fragment: str
) -> None:
    fill(db)
    run = prune(db, f"--idempotency-keep={value}")
    assert run.code == 2 and fragment in run.err and "Traceback" not in run.err, run.err
    assert len(run.err.splitlines()) == 1, run.err
    assert len(keys(db)) == 5


def test_stats_counts_the_keys_by_what_they_are_now(db: Database) -> None:
    fill(db)
    run = cli("stats", "--json", *options(db))
    assert run.code == 0, run.err
    report = json.loads(run.out)["idempotency_keys"]
    assert report == {
        "table": db.tables.idempotency_keys.fullname,
        "live": 1,
        "expired": 2,
        "in_flight": 1,
        "abandoned": 1,
        "not_stored": 1,
    }
    text_run = cli("stats", *options(db))
    assert text_run.code == 0, text_run.err
    assert f"idempotency keys ({db.tables.idempotency_keys.fullname}):" in text_run.out
    lines = text_run.out.splitlines()
    header = lines.index(f"idempotency keys ({db.tables.idempotency_keys.fullname}):")
    counts = next(line for line in lines[header + 1 :] if line.split()[:1] == ["1"])
    assert counts.split() == ["1", "2", "1", "1", "1"], text_run.out
    prune(db)
    after = json.loads(cli("stats", "--json", *options(db)).out)["idempotency_keys"]
    assert (after["expired"], after["abandoned"], after["live"]) == (0, 0, 1)
