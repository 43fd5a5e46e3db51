"""Pruner and the HTTP idempotency keys, on real SQLite and PostgreSQL rows.

The records are made by the SQL store itself (claims and completions at chosen times), so
the pruner is tested against the rows the middleware really writes: what is past its
stored expiry goes, what lives stays, an in-flight claim is never deleted while its lease
holds, and after pruning the same key is a new request.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text

from consumerdedup import ConfigurationError, Pruner
from consumerdedup.http.sql_store import SqlStore
from consumerdedup.http.store import Claimed, Completed, Mismatch
from consumerdedup.http.stored import StoredResponse
from consumerdedup.prune.idempotency import ABANDONED_KEEP
from tests.conftest import Database, database

NOW = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
HOUR = timedelta(hours=1)
DAY = timedelta(days=1)
SCOPE = "POST /payments"
OK = StoredResponse(201, (("content-type", "application/json"),), b'{"id": 1}')


@pytest.fixture(params=["sqlite", "postgresql", "mariadb"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    yield from database(request, request.param, tmp_path)


def store_at(db: Database, moment: datetime) -> SqlStore:
    return SqlStore(db.engine, db.tables, clock=lambda: moment)


def completed(db: Database, key: str, at: datetime, expiry: timedelta, ok: bool = True) -> None:
    store = store_at(db, at)
    claimed = store.claim(SCOPE, key, "fp", timedelta(minutes=1))
    assert isinstance(claimed, Claimed)
    response = OK if ok else StoredResponse.unreplayable(201)
    assert store.complete(SCOPE, key, claimed.token, response, expiry)


def in_flight(db: Database, key: str, at: datetime, lease: timedelta) -> None:
    assert isinstance(store_at(db, at).claim(SCOPE, key, "fp", lease), Claimed)


def keys(db: Database) -> set[str]:
    table = db.tables.idempotency_keys
    with db.engine.connect() as conn:
        return set(conn.execute(select(table.c.key)).scalars())


def pruner(db: Database, **options: Any) -> Pruner:
    options.setdefault("tables", db.tables)
    options.setdefault("clock", lambda: NOW)
    return Pruner(db.engine, timedelta(days=7), **options)


def fill(db: Database) -> None:
    completed(db, "expired", NOW - 2 * DAY, DAY)  # expired a day ago
    completed(db, "just-expired", NOW - DAY, DAY)  # expires_at == now: gone (not a live key)
    completed(db, "live", NOW - 23 * HOUR, DAY)  # an hour left
    completed(db, "long-lived", NOW - 3 * HOUR, 30 * DAY)
    completed(db, "not-stored-expired", NOW - 2 * DAY, DAY, ok=False)
    # An in-flight claim whose worker died two days ago (lease long over), and one whose
    # lease holds though it began long ago (a slow endpoint renewing its lease).
    in_flight(db, "abandoned-old", NOW - 2 * DAY, timedelta(minutes=1))
    in_flight(db, "abandoned-recent", NOW - HOUR, timedelta(minutes=1))
    in_flight(db, "running", NOW - 3 * DAY, 4 * DAY)


def test_keys_past_their_stored_expiry_go_and_live_ones_stay(db: Database) -> None:
    fill(db)
    report = pruner(db).run_once()
    assert keys(db) == {"live", "long-lived", "abandoned-recent", "running"}
    assert report.idempotency_keys == 4 and report.total == 4


def test_keep_shortens_every_key_life_but_never_a_held_lease(db: Database) -> None:
    fill(db)
    report = pruner(db, idempotency_keep=2 * HOUR).run_once()
    # long-lived (created 3 h ago) goes despite its 30-day expiry; running holds its lease.
    assert keys(db) == {"abandoned-recent", "running"}
    assert report.idempotency_keys == 6


def test_an_abandoned_claim_goes_after_the_default_expiry(db: Database) -> None:
    in_flight(db, "a", NOW - ABANDONED_KEEP - timedelta(seconds=1), timedelta(minutes=1))
    in_flight(db, "b", NOW - ABANDONED_KEEP + timedelta(seconds=1), timedelta(minutes=1))
    pruner(db).run_once()
    assert keys(db) == {"b"}


def test_a_dry_run_counts_and_deletes_nothing(db: Database) -> None:
    fill(db)
    report = pruner(db, dry_run=True).run_once()
    assert report.dry_run and report.idempotency_keys == 4
    assert len(keys(db)) == 8


def test_none_leaves_the_table_alone(db: Database) -> None:
    fill(db)
    assert pruner(db, idempotency_keep=None).run_once().idempotency_keys == 0
    assert len(keys(db)) == 8


def test_batches_take_every_expired_key(db: Database) -> None:
    table = db.tables.idempotency_keys
    rows = [
        {
            "scope": SCOPE,
            "key": f"k{i}",
            "fingerprint": "fp",
            "state": "completed",
            "status": 201,
            "headers": [],
            "body": b"",
            "created_at": NOW - 2 * DAY,
            "expires_at": NOW - DAY if i % 3 else NOW + DAY,
        }
        for i in range(25)
    ]
    with db.engine.begin() as conn:
        conn.execute(table.insert(), rows)
    report = pruner(db, batch_size=4).run_once()
    assert report.idempotency_keys == 16
    assert keys(db) == {f"k{i}" for i in range(25) if i % 3 == 0}


def test_after_pruning_the_same_key_is_a_new_request(db: Database) -> None:
    completed(db, "k", NOW - 2 * DAY, DAY)
    pruner(db).run_once()
    # Another body with the key is no longer a mismatch: the record is gone, the key is new.
    assert isinstance(store_at(db, NOW).claim(SCOPE, "k", "other", HOUR), Claimed)


def test_a_key_the_pruner_keeps_still_replays(db: Database) -> None:
    completed(db, "k", NOW - HOUR, DAY)
    pruner(db, idempotency_keep=2 * HOUR).run_once()
    store = store_at(db, NOW)
    assert store.claim(SCOPE, "k", "fp", HOUR) == Completed(OK)
    assert store.claim(SCOPE, "k", "other", HOUR) == Mismatch()


def test_a_database_without_the_table_is_pruned_as_before(db: Database) -> None:
    table = db.tables.idempotency_keys
    with db.engine.begin() as conn:
        conn.execute(text(f"DROP TABLE {db.name(table.name)}"))
    report = pruner(db).run_once()
    assert report.idempotency_keys == 0 and not report.skipped


@pytest.mark.parametrize("keep", [timedelta(0), -HOUR, "24h", 5])
def test_a_keep_that_is_not_a_positive_duration_is_refused(db: Database, keep: object) -> None:
    with pytest.raises(ConfigurationError, match="idempotency_keep"):
        pruner(db, idempotency_keep=keep)
