"""Idempotency keys written by the SQL store at chosen times: one of each condition."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from consumerdedup.http.sql_store import SqlStore
from consumerdedup.http.store import Claimed
from consumerdedup.http.stored import StoredResponse
from tests.conftest import Database

HOUR = timedelta(hours=1)
DAY = timedelta(days=1)
SCOPE = "POST /payments @0f3c9a1b2c3d4e5f60718293a4b5c6d7"
OTHER = "PUT /orders/{id}"


def fill(db: Database) -> None:
    """expired, expired-not-stored, live (on SCOPE), running (lease holds), abandoned (lease
    over), and live-order on OTHER."""
    now = datetime.now(UTC)

    def store(ago: timedelta) -> SqlStore:
        return SqlStore(db.engine, db.tables, clock=lambda: now - ago)

    def completed(key: str, ago: timedelta, expiry: timedelta, scope: str = SCOPE) -> None:
        claimed = store(ago).claim(scope, key, "fp", timedelta(minutes=1))
        assert isinstance(claimed, Claimed)
        headers = (("content-type", "application/json"),)
        response = StoredResponse(201, headers, b'{"payment": "p-1"}')
        if key.endswith("not-stored"):
            response = StoredResponse.unreplayable(200)
        assert store(ago).complete(scope, key, claimed.token, response, expiry)

    completed("expired", 2 * DAY, DAY)
    completed("expired-not-stored", 2 * DAY, DAY)
    completed("live", 3 * HOUR, DAY)
    completed("live-order", HOUR, DAY, scope=OTHER)
    assert isinstance(store(HOUR).claim(SCOPE, "running", "fp", DAY), Claimed)
    assert isinstance(store(2 * DAY).claim(SCOPE, "abandoned", "fp", HOUR), Claimed)
