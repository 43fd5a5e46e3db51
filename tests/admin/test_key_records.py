"""consumerdedup.http.key_records, the Idempotency keys page's functions, on SQLite and
PostgreSQL: pages by condition and route in key order with a cursor; one key with its
stored response; purge deletes an expired or abandoned key and never a live one or a
claim whose lease holds (checked in the DELETE)."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from consumerdedup.errors import ConfigurationError
from consumerdedup.http import key_records
from tests.admin.key_fill import OTHER, SCOPE, fill
from tests.conftest import Database


def keys(db: Database) -> set[str]:
    table = db.tables.idempotency_keys
    with db.engine.connect() as conn:
        return set(conn.execute(select(table.c.key)).scalars())


def listed(db: Database, **given: object) -> list[str]:
    page = key_records.list_keys(db.engine, tables=db.tables, **given)  # type: ignore[arg-type]
    return [r.key for r in page.records]


def test_pages_by_condition_and_route(db: Database) -> None:
    fill(db)
    assert listed(db, condition="expired") == ["expired", "expired-not-stored"]
    assert listed(db, condition="abandoned") == ["abandoned"]
    assert listed(db, condition="in_flight") == ["running"]
    assert listed(db, condition="live") == ["live", "live-order"]
    assert listed(db, route="PUT /orders") == ["live-order"]
    first = key_records.list_keys(db.engine, limit=4, tables=db.tables)
    assert [r.key for r in first.records] == ["abandoned", "expired", "expired-not-stored", "live"]
    rest = key_records.list_keys(db.engine, limit=4, after=first.next_cursor, tables=db.tables)
    assert [r.key for r in rest.records] == ["running", "live-order"] and rest.next_cursor is None
    assert {r.condition for r in first.records} == {"abandoned", "expired", "live"}
    with pytest.raises(ConfigurationError, match="condition"):
        key_records.list_keys(db.engine, condition="stale", tables=db.tables)
    with pytest.raises(ConfigurationError):
        key_records.list_keys(db.engine, after="not-a-cursor", tables=db.tables)


def test_one_key_shows_its_stored_response(db: Database) -> None:
    fill(db)
    found = key_records.show_key(db.engine, SCOPE, "live", tables=db.tables)
    assert found is not None and found.status == 201 and found.condition == "live"
    assert found.body == b'{"payment": "p-1"}'
    assert "body" not in found.as_dict()
    assert found.as_dict(body=True)["body"] == '{"payment": "p-1"}'
    assert key_records.show_key(db.engine, OTHER, "live", tables=db.tables) is None


def test_purge_takes_expired_and_abandoned_keys_only(db: Database) -> None:
    fill(db)
    every = [(SCOPE, k) for k in ("live", "running", "expired", "abandoned", "nothing")]
    would = key_records.purge(db.engine, every, dry_run=True, tables=db.tables)
    assert would == [(SCOPE, "expired"), (SCOPE, "abandoned")] and len(keys(db)) == 6
    done = key_records.purge(db.engine, every, tables=db.tables)
    assert done == [(SCOPE, "expired"), (SCOPE, "abandoned")]
    assert keys(db) == {"live", "running", "expired-not-stored", "live-order"}
