"""Round 8 attacks on the faster relay (362a325, 783da86, 6aec261, 2fb7d33): the second
pass sent straight to psycopg, rows in binary format, a fast path for an all-confirmed
window, and drain() on one connection. Public API only: Outbox.add, OutboxRelay,
consumerdedup.outbox.parked (the operator's replay/abandon), MemoryBroker.

Broke, and fixed (now regression tests):
- per-key order through a row lock another transaction holds on a key's oldest event (the
  application's FOR UPDATE / FOR SHARE / UPDATE, a foreign key's KEY SHARE): the claim's
  SKIP LOCKED passed over it and the key's later events went first, in both passes. Now
  the rows of a claimed key after one of its rows that did not come back wait for the
  next round (statements.RelayStatements: ``_blocked_now`` in the first pass,
  ``_in_key_order`` in the second);
- the all-confirmed fast path (783da86) counted outcomes with ``list.count(None)``, which
  an error type's permissive ``__eq__`` could answer: now ``is None`` each;
- a row written by hand went out with its headers' event_id, or none: the event_id
  column is now set as the header (rounds.headers_of);
- headers stored as JSON null went out as no headers: now that row's failure, alone.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from consumerdedup import Outbox, OutboxRelay, RelayConfig
from consumerdedup.errors import ConfigurationError
from consumerdedup.outbox import parked
from consumerdedup.outbox.publisher import Outgoing
from consumerdedup.testing import MemoryBroker
from tests.conftest import Database

pytestmark = pytest.mark.postgres

NOW = RelayConfig(batch_size=10, initial_backoff=timedelta(0), max_backoff=timedelta(0))
LATER = RelayConfig(
    batch_size=10, initial_backoff=timedelta(hours=1), max_backoff=timedelta(hours=1)
)


def add(
    db: Database, events: Sequence[tuple[str, str | None]], destination: str = "q"
) -> list[str]:
    outbox = Outbox(db.tables)
    with Session(db.engine) as session, session.begin():
        return [outbox.add(session, destination, b.encode(), key=k) for b, k in events]


def bodies(broker: MemoryBroker, destination: str = "q") -> list[str]:
    return [m.body.decode() for m in broker.messages(destination)]


def first_copies(seen: list[str]) -> list[str]:
    return list(dict.fromkeys(seen))


def of_key(seen: list[str], prefix: str) -> list[str]:
    return [b for b in first_copies(seen) if b.startswith(prefix)]


def raw_row(
    db: Database, row_id: int | None, key: str | None, headers: str, body: bytes = b"x"
) -> str:
    """An outbox row written by hand (raw SQL), as an older release or a migration could."""
    event_id = str(uuid.uuid4())
    override = "OVERRIDING SYSTEM VALUE" if row_id is not None else ""
    id_col, id_val = ("id, ", ":id, ") if row_id is not None else ("", "")
    with db.engine.begin() as conn:
        conn.execute(
            text(
                f"INSERT INTO {db.name('outbox')} ({id_col}event_id, destination, key, body, "
                f"headers, created_at, available_at) {override} VALUES ({id_val}:eid, 'q', :k, "
                ":b, CAST(:h AS json), now(), now())"
            ),
            {"id": row_id, "eid": event_id, "k": key, "b": body, "h": headers},
        )
    return event_id


def state(db: Database) -> dict[str, Any]:
    ob = db.tables.outbox
    with db.engine.connect() as conn:
        return {
            r.body.decode(errors="replace"): r for r in conn.execute(select(ob).order_by(ob.c.id))
        }


# 1. Per-key order against a row lock held by somebody who is not a relay ----------------

LOCKS = {
    "select-for-update": "SELECT 1 FROM {t} WHERE id = :id FOR UPDATE",
    "select-for-share": "SELECT 1 FROM {t} WHERE id = :id FOR SHARE",
    "update-a-column": "UPDATE {t} SET last_error = 'looked at by support' WHERE id = :id",
    # An application table with a foreign key to the outbox's event_id: inserting a row that
    # references an event takes FOR KEY SHARE on it, which FOR UPDATE SKIP LOCKED skips.
    "foreign-key-reference": (
        "INSERT INTO {t}_refs (event_id) SELECT event_id FROM {t} WHERE id = :id"
    ),
}


@pytest.mark.parametrize("how", sorted(LOCKS))
def test_a_row_lock_on_a_keys_oldest_event_does_not_let_its_later_events_overtake(
    pg: Database, how: str
) -> None:
    add(pg, [("k0", "K"), ("k1", "K"), ("k2", "K"), ("o0", "O")])
    oldest = pg.scalar(f"SELECT min(id) FROM {pg.name('outbox')} WHERE key = 'K'")
    with pg.engine.begin() as conn:
        t = pg.name("outbox")
        conn.execute(text(f"CREATE TABLE {t}_refs (event_id VARCHAR(64) REFERENCES {t}(event_id))"))
    broker = MemoryBroker()
    relay = OutboxRelay(pg.engine, broker, tables=pg.tables, config=NOW)
    with pg.engine.connect() as app:
        tx = app.begin()
        app.execute(text(LOCKS[how].format(t=pg.name("outbox"))), {"id": oldest})
        relay.run_once()  # the app's transaction is still open
        tx.rollback()
    relay.drain()
    seen = bodies(broker)
    assert "o0" in seen  # other keys are not held up
    assert of_key(seen, "k") == ["k0", "k1", "k2"]


def test_a_row_lock_held_with_a_small_batch_through_the_second_pass(pg: Database) -> None:
    """The same attack with batch_size=2, so the second pass (candidates, key locks, _rows)
    is what claims."""
    add(pg, [("k0", "K"), ("k1", "K"), ("k2", "K")])
    oldest = pg.scalar(f"SELECT min(id) FROM {pg.name('outbox')} WHERE key = 'K'")
    broker = MemoryBroker()
    relay = OutboxRelay(pg.engine, broker, tables=pg.tables, config=RelayConfig(batch_size=2))
    with pg.engine.connect() as app, app.begin():
        app.execute(
            text(f"SELECT 1 FROM {pg.name('outbox')} WHERE id = :id FOR UPDATE"), {"id": oldest}
        )
        relay.run_once()
    assert bodies(broker) == []  # nothing of K may go while k0 cannot


def _during(engine: Engine, verb: str, action: Any) -> None:
    """Run ``action`` once, right after ``engine`` ran its first statement starting with
    ``verb``, inside that statement's still-open transaction."""
    fired: list[bool] = []

    @event.listens_for(engine, "after_cursor_execute")
    def hook(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith(verb) and not fired:
            fired.append(True)
            action()


def _park_k0(pg: Database) -> str:
    """k0 of key K parked (its publish refused with max_attempts=1), k1 and k2 behind it."""
    ids = add(pg, [("k0", "K"), ("k1", "K"), ("k2", "K")])

    class RefuseK0(MemoryBroker):
        def publish(
            self, destination: str, body: bytes, key: Any = None, headers: Any = None, **kw: Any
        ) -> None:
            if body == b"k0":
                raise ValueError("refused k0")
            super().publish(destination, body, key, headers, **kw)

    refusing = RefuseK0()
    OutboxRelay(pg.engine, refusing, tables=pg.tables, config=RelayConfig(max_attempts=1)).drain()
    assert bodies(refusing) == []
    assert state(pg)["k0"].parked_at is not None
    return ids[0]


@pytest.mark.parametrize("operation", ["replay", "abandon"])
def test_an_operator_change_in_flight_does_not_let_a_keys_later_events_overtake(
    pg: Database, operation: str
) -> None:
    k0 = _park_k0(pg)
    broker = MemoryBroker()
    relay = OutboxRelay(pg.engine, broker, tables=pg.tables, config=NOW)
    relay.drain()  # start checks done, nothing may go
    during: list[int] = []
    operator = create_engine(pg.url)
    try:
        _during(operator, "UPDATE", lambda: during.append(relay.run_once()))
        if operation == "replay":
            assert parked.replay(operator, [k0], tables=pg.tables) == [k0]
        else:
            assert parked.abandon(operator, [k0], by="ops", reason="t", tables=pg.tables) == [k0]
    finally:
        operator.dispose()
    assert during == [0]  # the parked k0 still held K while the change was uncommitted
    relay.drain()
    expected = ["k0", "k1", "k2"] if operation == "replay" else ["k1", "k2"]
    assert first_copies(bodies(broker)) == expected


# 2. drain() on one connection ---------------------------------------------------------


@pytest.fixture
def own_engine(pg: Database) -> Iterator[Engine]:
    engine = create_engine(pg.url, pool_pre_ping=True)
    yield engine
    engine.dispose()


def test_drain_whose_connection_is_killed_between_rounds_raises_and_loses_nothing(
    pg: Database, own_engine: Engine
) -> None:
    """Round 2's BEGIN finds its server process terminated (pg_terminate_backend from
    another connection): drain raises a driver error (not a hang, not a silent 0); round 1's
    marks stand, and the next drain publishes the rest, in key order."""
    add(pg, [(f"c{i}", "C") for i in range(4)] + [(f"d{i}", "D") for i in range(4)])
    broker = MemoryBroker()
    relay = OutboxRelay(own_engine, broker, tables=pg.tables, config=RelayConfig(batch_size=3))
    begins: list[int] = []

    @event.listens_for(own_engine, "begin")
    def kill_on_second_round(conn: Any) -> None:
        if broker.published and not begins:  # the round after the first that published
            begins.append(1)
            pid = conn.connection.driver_connection.info.backend_pid
            with pg.engine.connect() as killer:
                killer.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})

    with pytest.raises(DBAPIError):
        relay.drain()
    event.remove(own_engine, "begin", kill_on_second_round)
    published_before = len(first_copies(bodies(broker)))
    assert (
        pg.scalar(f"SELECT count(*) FROM {pg.name('outbox')} WHERE published_at IS NOT NULL") == 3
    )
    assert relay.drain() == 5
    seen = bodies(broker)
    assert published_before == 3  # round 1's three confirmed rows were marked and kept
    for key in "cd":
        assert of_key(seen, key) == [f"{key}{i}" for i in range(4)]
    assert pg.scalar(f"SELECT count(*) FROM {pg.name('outbox')} WHERE published_at IS NULL") == 0


def test_drain_mid_round_kill_from_the_publisher_loses_nothing(
    pg: Database, own_engine: Engine
) -> None:
    """The relay's server process terminated while its round waits on the broker: the
    confirmed rows of that round are not marked (the commit cannot happen), drain raises,
    and the next drain publishes them again: at least once, in key order."""
    add(pg, [(f"a{i}", "A") for i in range(5)])
    killer = create_engine(pg.url)
    calls: list[int] = []

    class KillsItsRelay(MemoryBroker):
        def publish(
            self, destination: str, body: bytes, key: Any = None, headers: Any = None, **kw: Any
        ) -> None:
            super().publish(destination, body, key, headers, **kw)
            calls.append(1)
            if len(calls) == 3:
                with killer.connect() as conn:
                    conn.execute(
                        text(
                            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                            "WHERE application_name = 'round8-relay'"
                        )
                    )

    relay_engine = create_engine(pg.url, connect_args={"application_name": "round8-relay"})
    try:
        broker = KillsItsRelay()
        relay = OutboxRelay(
            relay_engine, broker, tables=pg.tables, config=RelayConfig(batch_size=2)
        )
        with pytest.raises(DBAPIError):
            relay.drain()
        relay.drain()
    finally:
        relay_engine.dispose()
        killer.dispose()
    seen = bodies(broker)
    assert first_copies(seen) == [f"a{i}" for i in range(5)]
    assert pg.scalar(f"SELECT count(*) FROM {pg.name('outbox')} WHERE published_at IS NULL") == 0


def test_drain_on_a_one_connection_pool_shared_with_the_application(pg: Database) -> None:
    """pool_size=1, no overflow, the application adding events from another thread while
    drain holds the one connection: the app waits for the pool (not forever), drain
    returns, and a second drain publishes what the app added. Nothing lost."""
    engine = create_engine(pg.url, pool_size=1, max_overflow=0, pool_timeout=10)
    shared = Database(pg.dialect, pg.url, pg.async_url, pg.schema, engine, pg.tables)
    try:
        add(shared, [(f"a{i}", "A") for i in range(6)])
        started = threading.Event()
        app_done = threading.Event()

        class Starter(MemoryBroker):
            def publish(self, *args: Any, **kw: Any) -> None:
                super().publish(*args, **kw)
                if not started.is_set():
                    started.set()
                    threading.Thread(target=app, daemon=True).start()

        def app() -> None:
            add(shared, [("late", "A")])
            app_done.set()

        broker = Starter()
        relay = OutboxRelay(engine, broker, tables=pg.tables, config=RelayConfig(batch_size=2))
        relay.drain()
        assert app_done.wait(10)
        relay.drain()
        assert first_copies(bodies(broker)) == [f"a{i}" for i in range(6)] + ["late"]
    finally:
        engine.dispose()


def test_two_threads_draining_one_relay_while_another_relay_runs(pg: Database) -> None:
    keys = [f"K{n}" for n in range(12)]
    add(pg, [(f"{k}-{i}", k) for i in range(8) for k in keys])
    broker = MemoryBroker()
    relay = OutboxRelay(
        pg.engine, broker, tables=pg.tables, config=RelayConfig(batch_size=7, publish_window=3)
    )
    runner = OutboxRelay(pg.engine, broker, tables=pg.tables, config=RelayConfig(batch_size=5))
    runner_thread = threading.Thread(target=runner.run, daemon=True)
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def drain() -> None:
        try:
            barrier.wait(5)
            relay.drain()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=drain) for _ in range(2)]
    runner_thread.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert runner.wait_drained(10)
    runner.stop()
    runner_thread.join(10)
    assert not errors
    seen = bodies(broker)
    for k in keys:
        assert of_key(seen, f"{k}-") == [f"{k}-{i}" for i in range(8)]
    assert len(first_copies(seen)) == 96


def test_a_rolled_back_add_publishes_nothing(pg: Database) -> None:
    outbox = Outbox(pg.tables)
    with Session(pg.engine) as session:
        session.begin()
        outbox.add(session, "q", b"ghost", key="G")
        session.rollback()
    add(pg, [("real", "G")])
    broker = MemoryBroker()
    assert OutboxRelay(pg.engine, broker, tables=pg.tables).drain() == 1
    assert bodies(broker) == ["real"]


# 3. Binary rows: hostile values -----------------------------------------------------


def test_hostile_values_round_trip_in_binary_format(pg: Database) -> None:
    outbox = Outbox(pg.tables)
    big = bytes(range(256)) * 4096  # 1 MiB, every byte value, NULs included
    key255 = "\U0001f600" + "k" * 254
    with Session(pg.engine) as session, session.begin():
        e1 = outbox.add(
            session, "q", b"\x00nul\x00", key="a\U0001f600", headers={"h\u00e9": "v\U0001f600"}
        )
        e2 = outbox.add(session, "q", big, key=key255)
        e3 = outbox.add(session, "q\u00e9\U0001f600", b"dest", key="z  ")
        e4 = outbox.add(session, "q", b"z-trimmed", key="z")
    for bad in ({"key": "x\udc00"}, {"destination": "q\udc00"}, {"headers": {"h": "\ud800"}}):
        with Session(pg.engine) as session, session.begin(), pytest.raises(ConfigurationError):
            args: dict[str, Any] = {"destination": "q", "key": None, "headers": None, **bad}
            outbox.add(session, args["destination"], b"b", key=args["key"], headers=args["headers"])
    broker = MemoryBroker()
    assert OutboxRelay(pg.engine, broker, tables=pg.tables).drain() == 4
    got = {m.id: m for m in broker.messages("q")}
    assert got[e1].body == b"\x00nul\x00" and got[e1].headers["h\u00e9"] == "v\U0001f600"
    assert got[e2].body == big
    assert got[e4].body == b"z-trimmed"
    (dest,) = broker.messages("q\u00e9\U0001f600")
    assert dest.id == e3 and dest.body == b"dest"


def test_hand_written_rows_with_odd_ids_and_headers_fail_alone(pg: Database) -> None:
    """Raw-SQL rows: ids far past int4 and negative (the id list goes in binary), a key with
    trailing spaces (its own key, not 'sp'), headers that are not a JSON object of strings
    (a list, a string, a number value, a nested object): those fail alone, with a reason, and
    hold only their key; every other row goes."""
    raw_row(pg, -5, "neg", '{"event_id":"n"}', b"neg")
    raw_row(pg, 2**40, "big", '{"event_id":"b1"}', b"big1")
    raw_row(pg, 2**62, "big", '{"event_id":"b2"}', b"big2")
    raw_row(pg, 2**40 + 1, "sp ", '{"event_id":"s1"}', b"sp-trailing")
    raw_row(pg, 2**40 + 2, "sp", '{"event_id":"s2"}', b"sp")
    raw_row(pg, 2**40 + 3, "bad", "[1,2]", b"bad-list")
    raw_row(pg, 2**40 + 4, "bad", '{"event_id":"b"}', b"bad-after")
    raw_row(pg, 2**40 + 5, "num", '{"a":1}', b"num")
    raw_row(pg, 2**40 + 6, "str", '"s"', b"str")
    raw_row(pg, 2**40 + 7, "nest", '{"a":{"b":"c"}}', b"nest")
    broker = MemoryBroker()
    relay = OutboxRelay(pg.engine, broker, tables=pg.tables, config=LATER)
    relay.drain()
    assert first_copies(bodies(broker)) == ["neg", "big1", "sp-trailing", "sp", "big2"]
    rows = state(pg)
    for body in ("bad-list", "num", "str", "nest"):
        assert rows[body].attempts == 1 and "headers must be a JSON object" in rows[body].last_error
    assert rows["bad-after"].attempts == 0 and rows["bad-after"].published_at is None


def test_json_null_headers_fail_alone(pg: Database) -> None:
    raw_row(pg, None, "j", "null", b"json-null")
    broker = MemoryBroker()
    OutboxRelay(pg.engine, broker, tables=pg.tables, config=LATER).drain()
    assert bodies(broker) == []
    assert state(pg)["json-null"].attempts == 1


def test_a_hand_written_row_is_published_with_its_event_id_column(pg: Database) -> None:
    missing = raw_row(pg, None, "m", "{}", b"missing")
    other = raw_row(pg, None, "o", '{"event_id":"not-mine"}', b"other")
    broker = MemoryBroker()
    OutboxRelay(pg.engine, broker, tables=pg.tables).drain()
    got = {m.body: m.id for m in broker.messages("q")}
    assert got == {b"missing": missing, b"other": other}


# 4. The all-confirmed fast path and odd publisher shapes ------------------------------


class Windowed(MemoryBroker):
    """A pipelining publisher double over MemoryBroker; ``shape`` bends what
    publish_window returns."""

    def __init__(self, shape: Any = None, refuse: bytes | None = None) -> None:
        super().__init__()
        self.shape = shape
        self.refuse = refuse
        self.windows: list[int] = []

    def publish_window(self, messages: Sequence[Outgoing]) -> Any:
        self.windows.append(len(messages))
        outcomes: list[BaseException | None] = []
        for m in messages:
            if m.body == self.refuse:
                outcomes.append(Refused("refused"))
            else:
                self.publish(m.destination, m.body, m.key, m.headers)
                outcomes.append(None)
        return self.shape(outcomes) if self.shape else outcomes


class Refused(Exception):
    pass


class EqualsEverything(Exception):
    """A publisher's error type whose __eq__ is permissive (as some value-object or
    mock-based error types are): the publisher protocol allows any BaseException."""

    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = Exception.__hash__


@pytest.mark.parametrize(
    "shape",
    [lambda o: o[:-1], lambda o: [*o, None]],
    ids=["fewer-outcomes", "more-outcomes"],
)
def test_a_window_with_the_wrong_number_of_outcomes_marks_nothing(pg: Database, shape: Any) -> None:
    add(pg, [("a0", "A"), ("a1", "A"), ("b0", "B")])
    broker = Windowed(shape)
    relay = OutboxRelay(pg.engine, broker, tables=pg.tables)
    with pytest.raises(ConfigurationError, match="one per message"):
        relay.drain()
    assert (
        pg.scalar(f"SELECT count(*) FROM {pg.name('outbox')} WHERE published_at IS NOT NULL") == 0
    )


def test_a_window_returned_as_a_generator_marks_nothing(pg: Database) -> None:
    add(pg, [("a0", "A"), ("a1", "A")])
    relay = OutboxRelay(pg.engine, Windowed(lambda o: iter(o)), tables=pg.tables)
    with pytest.raises(ConfigurationError, match="must return a list"):
        relay.drain()
    assert (
        pg.scalar(f"SELECT count(*) FROM {pg.name('outbox')} WHERE published_at IS NOT NULL") == 0
    )
    broker = MemoryBroker()
    OutboxRelay(pg.engine, broker, tables=pg.tables).drain()
    assert bodies(broker) == ["a0", "a1"]


def test_a_window_returned_as_a_tuple_is_taken(pg: Database) -> None:
    add(pg, [("a0", "A"), ("a1", "A")])
    broker = Windowed(tuple)
    assert OutboxRelay(pg.engine, broker, tables=pg.tables).drain() == 2


def test_a_key_held_in_an_earlier_window_stays_held_in_later_all_confirmed_windows(
    pg: Database,
) -> None:
    add(
        pg,
        [("a0", "A"), ("b0", "B"), ("a1", "A"), ("b1", "B"), ("c0", "C"), ("a2", "A"), ("c1", "C")],
    )
    broker = Windowed(refuse=b"a0")
    relay = OutboxRelay(
        pg.engine, broker, tables=pg.tables, config=RelayConfig(publish_window=2, **_later())
    )
    relay.drain()
    seen = bodies(broker)
    assert of_key(seen, "a") == []
    assert of_key(seen, "b") == ["b0", "b1"] and of_key(seen, "c") == ["c0", "c1"]
    rows = state(pg)
    assert rows["a0"].attempts == 1
    assert all(rows[b].published_at is None and rows[b].attempts == 0 for b in ("a1", "a2"))


def _later() -> dict[str, Any]:
    return {"initial_backoff": timedelta(hours=1), "max_backoff": timedelta(hours=1)}


def test_an_error_outcome_equal_to_none_is_not_taken_for_a_confirm(pg: Database) -> None:
    add(pg, [("a0", "A"), ("b0", "B")])

    class Permissive(Windowed):
        def publish_window(self, messages: Sequence[Outgoing]) -> Any:
            outcomes: list[BaseException | None] = []
            for m in messages:
                if m.body == b"a0":
                    outcomes.append(EqualsEverything("refused a0"))
                else:
                    self.publish(m.destination, m.body, m.key, m.headers)
                    outcomes.append(None)
            return outcomes

    broker = Permissive()
    OutboxRelay(pg.engine, broker, tables=pg.tables, config=LATER).drain()
    assert bodies(broker) == ["b0"]
    assert state(pg)["a0"].published_at is None
