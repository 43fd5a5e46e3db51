"""The relay's round statements sent straight to psycopg (consumerdedup.db.direct): the
same rows, the same isolation, the same errors as through SQLAlchemy; and SQLAlchemy's
path whenever someone listens to the engine's statements."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import create_engine, event, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from consumerdedup import Outbox, OutboxRelay, Publisher
from consumerdedup.outbox.statements import Claimed
from consumerdedup.schema import utcnow
from consumerdedup.testing import MemoryBroker
from tests.conftest import Database

pytestmark = pytest.mark.postgres


def add(db: Database, events: list[tuple[str, str | None]]) -> None:
    outbox = Outbox(db.tables)
    with Session(db.engine) as session, session.begin():
        for body, key in events:
            outbox.add(session, "orders", body.encode(), key=key, headers={"trace": body})


def test_a_round_without_listeners_goes_straight_to_psycopg_and_publishes_in_order(
    pg: Database,
) -> None:
    add(pg, [("a:0", "a"), ("b:0", "b"), ("a:1", "a"), ("loose", None)])
    relay = OutboxRelay(pg.engine, broker := MemoryBroker(), tables=pg.tables)
    with pg.engine.connect() as conn, conn.begin():
        claimed = relay.statements.claim(conn, utcnow(), 10)
        assert [type(row) for row in claimed] == [Claimed] * 4  # the direct path's rows
        assert [row.body for row in claimed] == [b"a:0", b"b:0", b"a:1", b"loose"]
        assert claimed[0].headers["trace"] == "a:0"
        conn.rollback()
    assert relay.run_once() == 4
    assert [m.body for m in broker.messages("orders")] == [b"a:0", b"b:0", b"a:1", b"loose"]
    assert [m.headers["trace"] for m in broker.messages("orders")] == ["a:0", "b:0", "a:1", "loose"]
    ob = pg.tables.outbox
    with pg.engine.connect() as conn:
        marked = conn.execute(select(ob.c.published_at, ob.c.last_error)).all()
    assert len(marked) == 4 and all(at is not None and error is None for at, error in marked)


def test_the_direct_claim_runs_at_read_committed_on_a_repeatable_read_engine(
    pg: Database,
) -> None:
    """The level is set on the DB-API connection before psycopg's own BEGIN: the direct
    statements run in that transaction, with a snapshot per statement."""
    engine = create_engine(pg.url, isolation_level="REPEATABLE READ")
    seen: list[str] = []

    class Looking(Publisher):
        """Asks, from inside the round (its transaction open), what level it runs at."""

        def __init__(self, conn: Any) -> None:
            self.conn = conn

        def publish(
            self, destination: str, body: bytes, key: Any = None, headers: Any = None
        ) -> None:
            seen.append(self.conn.execute("SHOW transaction_isolation").fetchone()[0])

    try:
        add(pg, [("k1", "k")])
        relay = OutboxRelay(engine, MemoryBroker(), tables=pg.tables)
        with engine.connect() as conn:
            raw = conn.connection.driver_connection  # the pool's one connection, reused
        relay.sender.publisher = Looking(raw)
        assert relay.run_once() == 1
        assert seen == ["read committed"]
    finally:
        engine.dispose()


def test_a_connection_lost_under_the_direct_claim_is_sqlalchemys_error_and_invalidated(
    pg: Database,
) -> None:
    engine = create_engine(pg.url, pool_size=1, max_overflow=0)
    try:
        relay = OutboxRelay(engine, broker := MemoryBroker(), tables=pg.tables)
        # A first round: the start checks pass and the pool's connection is open (a
        # connection lost under the start checks is an outage they report, not this).
        assert relay.run_once() == 0
        add(pg, [("k1", "k")])
        with engine.connect() as conn:
            pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
        with pg.engine.begin() as other:
            other.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        with pytest.raises(DBAPIError) as raised:
            relay.run_once()
        assert raised.value.connection_invalidated
        assert relay.run_once() == 1  # a fresh connection: the pool saw the loss
        assert [m.body for m in broker.messages("orders")] == [b"k1"]
    finally:
        engine.dispose()


def test_a_listener_on_the_engine_sees_every_statement_of_the_round(pg: Database) -> None:
    """Tracing and test hooks listen to before_cursor_execute: with one there, the round
    goes through SQLAlchemy, so they miss nothing."""
    engine = create_engine(pg.url)
    statements: list[str] = []

    @event.listens_for(engine, "before_cursor_execute")
    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    try:
        add(pg, [("k1", "k")])
        assert OutboxRelay(engine, MemoryBroker(), tables=pg.tables).run_once() == 1
        assert any("pg_try_advisory_xact_lock" in s for s in statements)
        assert any(s.startswith("UPDATE") and "published_at" in s for s in statements)
    finally:
        engine.dispose()
