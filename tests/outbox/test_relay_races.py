"""Two relays on one outbox, interleaved on purpose: a row one relay has just put into
backoff or parked is not published by the other, whose scan saw it a moment earlier.

Relay A reads its candidates; before it locks them, relay B runs a whole round
that fails those rows and commits. A then locks the keys and re-reads the rows:
what it publishes must follow what B decided.

And the other way round: while relay A waits on the broker for a key's row, a newer row
of that key is committed; relay B's round meanwhile must leave the key alone.

On PostgreSQL and MariaDB (where no key lock exists: B's scan finds k:0, its row lock
skips it, and the key waits from there).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, select
from sqlalchemy.orm import Session

from consumerdedup import Outbox, OutboxRelay, Publisher, RelayConfig
from consumerdedup.testing import MemoryBroker
from tests.conftest import Database
from tests.outbox.conftest import installed

pytestmark = pytest.mark.postgres

LATER = RelayConfig(initial_backoff=timedelta(hours=1), max_backoff=timedelta(hours=1))


class Refusing(Publisher):
    """A publisher whose broker refuses everything (it is not away: attempts are charged)."""

    def __init__(self) -> None:
        self.calls: list[bytes] = []

    def publish(self, destination: str, body: bytes, key: Any = None, headers: Any = None) -> None:
        self.calls.append(body)
        raise ValueError(f"refused {body.decode()}")


@pytest.fixture(params=["postgresql", "mariadb"])
def pg(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """The servers (PostgreSQL: key locks and row locks; MariaDB: row locks alone)."""
    yield from installed(request, request.param, tmp_path)


@pytest.fixture
def postgres(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    yield from installed(request, "postgresql", tmp_path)


@pytest.fixture
def engine_a(pg: Database) -> Iterator[Engine]:
    """Relay A's own engine, so a hook on it does not fire for relay B."""
    engine = create_engine(pg.url)
    yield engine
    engine.dispose()


def run_first_when_a_locks(engine: Engine, round_b: Any) -> None:
    """Run ``round_b`` once, on its own connection, just before relay A locks what it scanned
    (the key locks, or the row locks when no row has a key)."""
    fired: list[bool] = []

    @event.listens_for(engine, "before_cursor_execute")
    def interleave(*args: Any) -> None:
        statement = args[2]
        locking = "pg_try_advisory_xact_lock" in statement or "FOR UPDATE" in statement
        if locking and not fired:
            fired.append(True)
            round_b()


def add(db: Database, events: list[tuple[str, str | None]]) -> None:
    outbox = Outbox(db.tables)
    with Session(db.engine) as session, session.begin():
        for body, key in events:
            outbox.add(session, "orders", body.encode(), key=key)


def rows(db: Database) -> dict[bytes, Any]:
    ob = db.tables.outbox
    with db.engine.connect() as conn:
        return {row.body: row for row in conn.execute(select(ob).order_by(ob.c.id))}


def test_a_row_another_relay_just_backed_off_is_not_published_before_its_time(
    pg: Database, engine_a: Engine
) -> None:
    add(pg, [("k1", "k"), ("k2", "k"), ("loose", None)])
    relay_b = OutboxRelay(pg.engine, Refusing(), tables=pg.tables, config=LATER)
    run_first_when_a_locks(engine_a, relay_b.run_once)
    broker = MemoryBroker()
    relay_a = OutboxRelay(engine_a, broker, tables=pg.tables, config=LATER)
    assert relay_a.run_once() == 0
    assert broker.messages("orders") == []  # k1 and loose back off for an hour; k2 waits on k1
    after = rows(pg)
    assert (after[b"k1"].attempts, after[b"k2"].attempts, after[b"loose"].attempts) == (1, 0, 1)
    assert all(row.published_at is None for row in after.values())


def test_a_row_another_relay_just_parked_is_not_tried_again(pg: Database, engine_a: Engine) -> None:
    once = RelayConfig(max_attempts=1, initial_backoff=timedelta(0), max_backoff=timedelta(0))
    add(pg, [("k1", "k"), ("loose", None)])
    relay_b = OutboxRelay(pg.engine, Refusing(), tables=pg.tables, config=once)
    run_first_when_a_locks(engine_a, relay_b.run_once)
    publisher_a = Refusing()
    relay_a = OutboxRelay(engine_a, publisher_a, tables=pg.tables, config=once)
    assert relay_a.run_once() == 0
    assert publisher_a.calls == []
    assert {row.attempts for row in rows(pg).values()} == {1}  # never past max_attempts
    assert sorted(error or "" for _, error in relay_a.parked()) == [
        "ValueError: refused k1",
        "ValueError: refused loose",
    ]


class Confirming(Publisher):
    """A MemoryBroker publisher that runs ``meanwhile`` once before the broker confirms
    ``first``: relay A's round, key lock and row locks held, waits there."""

    def __init__(self, broker: MemoryBroker, first: bytes, meanwhile: Any) -> None:
        self.broker, self.first, self.meanwhile = broker, first, meanwhile

    def publish(self, destination: str, body: bytes, key: Any = None, headers: Any = None) -> None:
        if body == self.first and self.meanwhile is not None:
            meanwhile, self.meanwhile = self.meanwhile, None
            meanwhile()
        self.broker.publish(destination, body, key=key, headers=headers)


def test_a_key_one_relay_is_publishing_is_left_alone_by_the_other(
    pg: Database, engine_a: Engine
) -> None:
    """Rows added while a relay runs: k:1 is committed while A publishes k:0. B's scan then
    sees k:0 (row-locked by A, skipped) and k:1 (free): only the key lock keeps B from
    publishing k:1 before k:0 is confirmed."""
    add(pg, [("k:0", "k")])
    broker = MemoryBroker()
    relay_b = OutboxRelay(pg.engine, broker, tables=pg.tables, config=LATER)
    during_a: list[bytes] = []

    def while_a_publishes_k0() -> None:
        add(pg, [("k:1", "k"), ("j:0", "j")])
        relay_b.run_once()
        during_a.extend(m.body for m in broker.messages("orders"))

    relay_a = OutboxRelay(
        engine_a, Confirming(broker, b"k:0", while_a_publishes_k0), tables=pg.tables, config=LATER
    )
    assert relay_a.run_once() == 1
    assert during_a == [b"j:0"], "relay B published key k while relay A held k:0 unconfirmed"
    assert relay_b.run_once() == 1  # k:1, now that A's round committed
    assert [m.body for m in broker.messages("orders")] == [b"j:0", b"k:0", b"k:1"]
    assert all(row.published_at is not None for row in rows(pg).values())


def test_a_relay_claims_at_read_committed_whatever_the_engine_was_made_with(
    postgres: Database,
) -> None:
    """The claim asks the keys' hold-backs again after taking its locks, in a statement of
    its own: only a snapshot per statement sees what another relay committed meanwhile. On
    a REPEATABLE READ engine that second look would see the first one's snapshot."""
    engine = create_engine(postgres.url, isolation_level="REPEATABLE READ")
    seen: list[str] = []

    @event.listens_for(engine, "before_cursor_execute")
    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "pg_try_advisory_xact_lock" in statement and not seen:
            level = cursor.connection.execute("SHOW transaction_isolation").fetchone()[0]
            seen.append(level)

    try:
        add(postgres, [("k1", "k")])
        broker = MemoryBroker()
        assert OutboxRelay(engine, broker, tables=postgres.tables).run_once() == 1
        assert seen == ["read committed"]
        assert [m.body for m in broker.messages("orders")] == [b"k1"]
        with engine.connect() as conn:  # the engine's own level is untouched for the user
            assert conn.exec_driver_sql("SHOW transaction_isolation").scalar() == "repeatable read"
    finally:
        engine.dispose()
