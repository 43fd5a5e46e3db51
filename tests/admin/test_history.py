"""consumerdedup.telemetry.history, the overview's charts, on SQLite and PostgreSQL:
FAILED records counted in the hour they failed (processed ones and older ones not at
all), the backlog at each hour's end from created_at, published_at and abandoned_at."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import insert

from consumerdedup.errors import ConfigurationError
from consumerdedup.telemetry.history import history
from tests.conftest import Database

NOW = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)
H = timedelta(hours=1)
M = timedelta(minutes=1)


def record(message_id: str, at: datetime, outcome: str = "failed") -> dict[str, object]:
    return {
        "consumer": "c",
        "message_id": message_id,
        "processed_at": at,
        "payload_hash": "0" * 64,
        "outcome": outcome,
        "error": "KeyError: 'x'" if outcome == "failed" else None,
    }


def event(event_id: str, created: datetime, **done: datetime) -> dict[str, object]:
    return {
        "event_id": event_id,
        "destination": "d",
        "body": b"{}",
        "created_at": created,
        "available_at": created,
        "attempts": 0,
        "headers": {},
        "published_at": None,
        "abandoned_at": None,
        **done,
    }


def test_the_last_hours_from_the_tables(db: Database) -> None:
    with db.engine.begin() as conn:
        conn.execute(
            insert(db.tables.processed_events),
            [
                record("a", NOW - 30 * M),  # the last hour
                record("b", NOW - 50 * M),
                record("c", NOW - 150 * M),  # three hours back
                record("d", NOW - 20 * M, "processed"),  # not a failure
                record("e", NOW - 30 * H),  # before the window
            ],
        )
        conn.execute(
            insert(db.tables.outbox),
            [
                event("waiting", NOW - 90 * M),
                event("sent", NOW - 5 * H + M, published_at=NOW - 2 * H - M),
                event("given-up", NOW - 4 * H + M, abandoned_at=NOW - 3 * H - M),
            ],
        )
    found = history(db.engine, db.tables, hours=6, now=NOW)
    assert found["hours"][-1] == NOW.isoformat() and len(found["hours"]) == 6
    assert found["failed"] == [0, 0, 0, 1, 0, 2]
    # Hour ends: -5h -4h -3h -2h -1h now. "sent" waits from -4h59 to -2h01, "given-up"
    # from -3h59 to -3h01, "waiting" from -1h30 on.
    assert found["backlog"] == [0, 1, 1, 0, 1, 1]
    with pytest.raises(ConfigurationError, match="hours"):
        history(db.engine, db.tables, hours=0)
