"""list_failed / show / forget on SQLite, PostgreSQL, the partitioned table and MariaDB."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, insert, select

from consumerdedup import ConfigurationError
from consumerdedup.failed import Filters, forget, list_failed, show
from tests.conftest import Database, database

NOW = datetime.now(UTC).replace(microsecond=0)


@pytest.fixture(params=["sqlite", "postgresql", "postgresql-partitioned", "mariadb"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    yield from database(request, request.param, tmp_path)


def add(db: Database, consumer: str, ids: list[str], outcome: str = "failed", **kw: object) -> None:
    at = kw.get("at", NOW)
    rows = [
        {
            "consumer": consumer,
            "message_id": i,
            "processed_at": at,
            "payload_hash": "0" * 64,
            "outcome": outcome,
            "error": None if outcome != "failed" else kw.get("error", f"KeyError: 'sku' ({i})"),
        }
        for i in ids
    ]
    with db.engine.begin() as conn:
        conn.execute(insert(db.tables.processed_events), rows)


def test_a_walk_over_10000_returns_each_once_while_failures_are_added(db: Database) -> None:
    add(db, "billing", [f"m{n:05d}" for n in range(10_000)])
    add(db, "billing", [f"done{n}" for n in range(500)], outcome="processed")
    seen: list[str] = []
    cursor, pages, added = None, 0, 0
    while True:
        page = list_failed(
            db.engine, Filters(consumer="billing"), limit=1000, after=cursor, tables=db.tables
        )
        seen += [r.message_id for r in page.records]
        pages += 1
        # New failures land before and after the cursor, mid-walk.
        add(db, "billing", [f"a{pages}", f"z{pages}"])
        added += 2
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    originals = [s for s in seen if s.startswith("m")]
    assert len(originals) == len(set(originals)) == 10_000
    assert len(seen) == len(set(seen))
    assert not any(s.startswith("done") for s in seen)
    assert pages <= 12


def test_filters_pages_and_show(db: Database) -> None:
    add(db, "billing", ["b1", "b2", "b3"], error="KeyError: 'sku'")
    add(db, "billing", ["old"], error="KeyError: 'sku'", at=NOW - timedelta(days=2))
    add(db, "billing", ["other"], error="PermanentError: card declined 100%")
    add(db, "mail", ["m1"], error="KeyError: 'sku'")
    add(db, "billing", ["ok"], outcome="processed")
    everything = list_failed(db.engine, tables=db.tables, limit=100)
    assert [(r.consumer, r.message_id) for r in everything.records] == [
        ("billing", "b1"),
        ("billing", "b2"),
        ("billing", "b3"),
        ("billing", "old"),
        ("billing", "other"),
        ("mail", "m1"),
    ]
    assert everything.next_cursor is None
    recent = Filters(consumer="billing", reason="keyerror", since=NOW - timedelta(hours=1))
    first = list_failed(db.engine, recent, limit=2, tables=db.tables)
    assert [r.message_id for r in first.records] == ["b1", "b2"]
    second = list_failed(db.engine, recent, limit=2, after=first.next_cursor, tables=db.tables)
    assert [r.message_id for r in second.records] == ["b3"] and second.next_cursor is None
    old = list_failed(db.engine, Filters(until=NOW - timedelta(days=1)), tables=db.tables)
    assert [r.message_id for r in old.records] == ["old"]
    literal = list_failed(db.engine, Filters(reason="100%"), tables=db.tables)
    assert [r.message_id for r in literal.records] == ["other"]
    record = show(db.engine, "billing", "b2", tables=db.tables)
    assert record is not None and record.reason == "KeyError: 'sku'"
    assert record.failed_at == NOW
    assert show(db.engine, "billing", "ok", tables=db.tables) is None
    for bad in (0, 1001, True):
        with pytest.raises(ConfigurationError):
            list_failed(db.engine, limit=bad, tables=db.tables)
    with pytest.raises(ConfigurationError, match="cursor"):
        list_failed(db.engine, after="not-a-cursor", tables=db.tables)


def test_forget_deletes_failed_records_only(db: Database) -> None:
    add(db, "billing", ["f1", "f2"])
    add(db, "billing", ["done"], outcome="processed")
    add(db, "mail", ["f1"])
    ids = ["f1", "done", "nothing", "f2"]
    assert forget(db.engine, "billing", ids, dry_run=True, tables=db.tables) == ["f1", "f2"]
    assert _count(db) == 4
    assert forget(db.engine, "billing", ids, tables=db.tables) == ["f1", "f2"]
    pe = db.tables.processed_events
    with db.engine.connect() as conn:
        left = conn.execute(select(pe.c.consumer, pe.c.message_id, pe.c.outcome)).all()
    assert sorted(left) == [("billing", "done", "processed"), ("mail", "f1", "failed")]
    assert forget(db.engine, "billing", ids, tables=db.tables) == []


def _count(db: Database) -> int:
    with db.engine.connect() as conn:
        return int(
            conn.execute(select(func.count()).select_from(db.tables.processed_events)).scalar_one()
        )
