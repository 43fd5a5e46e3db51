"""Parked is a stored state: set by the relay that parks, honoured by every relay whatever its
max_attempts; replay and abandon (consumerdedup.outbox.parked), and the pruner's share."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from consumerdedup import OutboxRelay, RelayConfig
from consumerdedup.errors import ConfigurationError
from consumerdedup.outbox import parked
from consumerdedup.prune import Pruner
from consumerdedup.schema import utcnow
from tests.conftest import Database
from tests.outbox.conftest import installed
from tests.outbox.test_outbox import FlakyPublisher, add_events, outbox_rows


@pytest.fixture(params=["sqlite", "postgresql", "mariadb"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    yield from installed(request, request.param, tmp_path)


def config(max_attempts: int) -> RelayConfig:
    no_wait = timedelta(0)
    return RelayConfig(max_attempts=max_attempts, initial_backoff=no_wait, max_backoff=no_wait)


def published(publisher: FlakyPublisher) -> list[str]:
    return [m.body.decode() for m in publisher.broker.messages("orders")]


def park_p1(db: Database) -> tuple[list[str], FlakyPublisher]:
    """p1 refused twice by a relay with max_attempts=2: parked, p2 (same key) held back."""
    ids = add_events(db, [("p1", "p"), ("p2", "p"), ("q1", "q")])
    publisher = FlakyPublisher({"p1": 99})
    relay = OutboxRelay(db.engine, publisher, tables=db.tables, config=config(2))
    for _ in range(4):
        relay.run_once()
    assert publisher.calls.count("p1") == 2
    return ids, publisher


def test_parked_is_stored_and_no_relay_publishes_it_whatever_its_setting(db: Database) -> None:
    ids, first = park_p1(db)
    row = next(r for r in outbox_rows(db) if r.body == b"p1")
    assert row.parked_at is not None and row.attempts == 2
    assert "2 failed publishes (max_attempts=2)" in row.parked_reason
    assert "refused p1" in row.parked_reason
    # A relay started with a higher setting neither tries p1 nor lets p2 overtake it.
    later = FlakyPublisher({})
    relay = OutboxRelay(db.engine, later, tables=db.tables, config=config(10))
    assert relay.drain() == 0
    assert later.calls == [] and published(first) == ["q1"]
    assert relay.parked() == [(ids[0], "ValueError: refused p1")]
    assert relay.backlog() == 1  # p2, held back behind p1


def test_replay_makes_the_relay_publish_it_then_the_key(db: Database) -> None:
    ids, _ = park_p1(db)
    assert parked.replay(db.engine, [ids[0], ids[2], "nope"], dry_run=True, tables=db.tables) == [
        ids[0]
    ]
    assert outbox_rows(db)[0].parked_at is not None  # a dry run changes nothing
    assert parked.replay(db.engine, [ids[0], ids[2], "nope"], tables=db.tables) == [ids[0]]
    row = outbox_rows(db)[0]
    assert (row.attempts, row.parked_at, row.parked_reason) == (0, None, None)
    assert parked.replay(db.engine, [ids[0]], tables=db.tables) == []  # no longer parked
    publisher = FlakyPublisher({})
    relay = OutboxRelay(db.engine, publisher, tables=db.tables, config=config(2))
    assert relay.drain() == 2
    assert published(publisher) == ["p1", "p2"]
    assert relay.parked() == [] and relay.backlog() == 0


def test_abandon_releases_the_key_and_is_never_published(db: Database) -> None:
    ids, _ = park_p1(db)
    with pytest.raises(ConfigurationError):
        parked.abandon(db.engine, [ids[0]], by="ops", reason=" ", tables=db.tables)
    done = parked.abandon(db.engine, [ids[0]], by="ops", reason="bad payload", tables=db.tables)
    assert done == [ids[0]]
    event = parked.show(db.engine, ids[0], tables=db.tables)
    assert event is not None and event.state == parked.ABANDONED
    assert (event.abandoned_by, event.abandoned_reason) == ("ops", "bad payload")
    assert event.abandoned_at is not None and event.body == b"p1"
    assert parked.replay(db.engine, [ids[0]], tables=db.tables) == []  # abandoned for good
    publisher = FlakyPublisher({})
    relay = OutboxRelay(db.engine, publisher, tables=db.tables, config=config(2))
    assert relay.drain() == 1
    assert published(publisher) == ["p2"]  # the later event goes; the abandoned one never
    assert relay.parked() == [] and relay.backlog() == 0
    assert [e.event_id for e in parked.list_parked(db.engine, tables=db.tables).events] == []
    gone = parked.list_parked(db.engine, abandoned=True, tables=db.tables).events
    assert [e.event_id for e in gone] == [ids[0]]


def test_pages_walk_the_parked_events_once_each(db: Database) -> None:
    add_events(db, [(f"e{n}", None) for n in range(7)])
    publisher = FlakyPublisher({f"e{n}": 99 for n in range(7) if n != 3})
    relay = OutboxRelay(db.engine, publisher, tables=db.tables, config=config(1))
    relay.drain()
    seen, cursor = [], None
    while True:
        page = parked.list_parked(db.engine, limit=2, after=cursor, tables=db.tables)
        seen += [e.event_id for e in page.events]
        assert all(e.state == parked.PARKED for e in page.events)
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert seen == [e for e, _ in relay.parked()] and len(seen) == 6
    with pytest.raises(ConfigurationError):
        parked.list_parked(db.engine, after="nonsense", tables=db.tables)
    with pytest.raises(ConfigurationError):
        parked.list_parked(db.engine, limit=1001, tables=db.tables)


def test_the_pruner_removes_abandoned_rows_past_the_outbox_cutoff(db: Database) -> None:
    ids, _ = park_p1(db)
    parked.abandon(db.engine, [ids[0]], by="ops", reason="gone", tables=db.tables)
    ob = db.tables.outbox
    with db.engine.begin() as conn:  # abandoned, and p1's key-mate published, a week ago
        past = utcnow() - timedelta(days=8)
        conn.execute(ob.update().where(ob.c.event_id == ids[0]).values(abandoned_at=past))
    pruner = Pruner(db.engine, timedelta(days=7), tables=db.tables, outbox_keep=timedelta(days=7))
    assert pruner.run_once().outbox == 1
    with db.engine.connect() as conn:
        left = set(conn.execute(select(ob.c.event_id)).scalars())
    assert left == {ids[1], ids[2]}  # p2 (held back) and q1 (published now) stay


def test_a_row_past_max_attempts_but_never_parked_is_tried_once_then_parked(
    db: Database,
) -> None:
    """An older release derived parked from attempts alone: such a row is tried again once,
    and stored as parked if it fails again (or published if the cause is gone)."""
    ids = add_events(db, [("old", "k"), ("cured", None), ("next", "k")])
    ob = db.tables.outbox
    with db.engine.begin() as conn:
        conn.execute(ob.update().where(ob.c.event_id.in_(ids[:2])).values(attempts=50))
    publisher = FlakyPublisher({"old": 1})
    relay = OutboxRelay(db.engine, publisher, tables=db.tables, config=config(10))
    relay.drain()
    assert publisher.calls == ["old", "cured"]
    assert relay.parked() == [(ids[0], "ValueError: refused old")]
    assert published(publisher) == ["cured"]  # "next" stays behind "old"
