"""Issue 17 on the relay: a malformed row fails alone, the NOTIFY channel is the table's own
whatever its spelling, a publisher that cannot start is the relay's fault."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select, update

from consumerdedup import OutboxRelay
from consumerdedup.testing import MemoryBroker
from tests.outbox.test_outbox import QUICK, add_events, outbox_rows


def test_a_row_with_malformed_headers_fails_alone_and_holds_only_its_key(db: Any) -> None:
    """Headers written by hand (a JSON string, a number as a value) used to raise from
    ``dict(row.headers)`` outside the publish handling: every round failed, for every key.
    Now that row is charged an attempt with the reason and holds back its key only."""
    ids = add_events(db, [("a1", "a"), ("a2", "a"), ("b1", "b"), ("c1", None), ("d1", "d")])
    ob = db.tables.outbox
    with db.engine.begin() as conn:
        conn.execute(update(ob).where(ob.c.event_id == ids[0]).values(headers="not an object"))
        conn.execute(update(ob).where(ob.c.event_id == ids[4]).values(headers={"n": 1}))
    broker = MemoryBroker()
    relay = OutboxRelay(db.engine, broker, tables=db.tables, config=QUICK)
    assert relay.run_once() == 2
    assert [m.body for m in broker.messages("orders")] == [b"b1", b"c1"]
    rows = {row.event_id: row for row in outbox_rows(db)}
    for bad in (ids[0], ids[4]):
        assert rows[bad].attempts == 1 and rows[bad].published_at is None
        assert "headers must be a JSON object of strings" in rows[bad].last_error
    assert rows[ids[1]].attempts == 0 and rows[ids[1]].published_at is None  # held behind a1
    with db.engine.begin() as conn:  # the operator repairs the row: it goes, then a2
        conn.execute(update(ob).where(ob.c.event_id == ids[0]).values(headers={}))
    relay.drain()
    assert [m.body for m in broker.messages("orders")] == [b"b1", b"c1", b"a1", b"a2"]
    with db.engine.connect() as conn:  # d1 is tried again each round, until parked
        assert conn.execute(select(ob.c.attempts).where(ob.c.event_id == ids[4])).scalar() > 1
