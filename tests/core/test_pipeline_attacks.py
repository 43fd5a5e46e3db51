"""The pipeline against handlers and inputs that real users write.

Each test checks the invariants on what the database holds: PROCESSED and
DUPLICATE have their effect and their record exactly once, FAILED its record
and no effect, RETRY neither; and every message is decided.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from consumerdedup import (
    InvalidMessage,
    Message,
    Outcome,
    PermanentError,
    Result,
    RetryLater,
    RetryPolicy,
)
from consumerdedup.errors import CommitInHandler, HeldBack, TransactionBroken
from tests.conftest import Database, database
from tests.support.flavors import COMMIT, NESTED, ROLLBACK, SWALLOW

FAST = RetryPolicy(attempts=3, initial_delay=timedelta(0), max_delay=timedelta(0))
CARD = "4111111111111111"


@pytest.fixture(params=["sqlite", "postgresql", "postgresql-partitioned"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    yield from database(request, request.param, tmp_path)


def order(mid: str, **data: Any) -> Message:
    return Message(id=mid, body=json.dumps({"n": 1, **data}).encode(), source="orders")


def effects(db: Database, ledger: str) -> list[str]:
    """The ledger's message ids in insertion order (a ledger has no unique key)."""
    with db.engine.connect() as conn:
        return [r[0] for r in conn.exec_driver_sql(f"SELECT message_id FROM {ledger} ORDER BY seq")]


def records(db: Database) -> dict[str, tuple[str, str | None]]:
    pe = db.tables.processed_events
    with db.engine.connect() as conn:
        return {r.message_id: (r.outcome, r.error) for r in conn.execute(pe.select())}


def create_ledger(db: Database) -> str:
    name = db.name("ledger")
    serial = "INTEGER PRIMARY KEY AUTOINCREMENT" if db.dialect == "sqlite" else "SERIAL PRIMARY KEY"
    with db.engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {name} (seq {serial}, message_id TEXT)")
    return name


def assert_invariants(db: Database, ledger: str, results: Sequence[Result]) -> None:
    done = effects(db, ledger)
    stored = records(db)
    for result in results:
        key = result.message.id
        outcome = result.outcome
        if outcome in (Outcome.PROCESSED, Outcome.DUPLICATE):
            assert done.count(key) == 1, (key, outcome, done)
            assert stored[key][0] == "processed", (key, stored.get(key))
        elif outcome is Outcome.FAILED:
            assert done.count(key) == 0, (key, outcome, done)
            if not isinstance(result.error, InvalidMessage):
                assert stored[key][0] == "failed", (key, stored.get(key))
        else:
            assert outcome is Outcome.RETRY
            assert done.count(key) == 0 and key not in stored, (key, done, stored)


def test_a_handler_that_swallows_a_database_error_is_never_processed(
    db: Database, flavor: Any
) -> None:
    ledger = create_ledger(db)
    taken = db.name("taken")
    with db.engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {taken} (k TEXT PRIMARY KEY)")
        conn.exec_driver_sql(f"INSERT INTO {taken} VALUES ('k')")

    def behavior(message: Message) -> list[tuple[str, dict[str, Any]]]:
        steps = [(f"INSERT INTO {ledger} (message_id) VALUES (:m)", {"m": message.id})]
        if message.json().get("swallow"):
            steps.append((f"{SWALLOW}INSERT INTO {taken} VALUES ('k')", {}))
        return steps

    handle = flavor.wrap(behavior, consumer="c", retry=FAST)
    alone = handle.process(order("s0", swallow=True))
    batch = handle.process_batch([order("b1"), order("b2", swallow=True), order("b3")])
    assert_invariants(db, ledger, [alone, *batch])
    assert [r.outcome for r in batch[::2]] == [Outcome.PROCESSED] * 2
    if db.dialect == "postgresql":  # PostgreSQL aborts the transaction; SQLite only the statement
        for result in (alone, batch[1]):
            assert result.outcome is Outcome.FAILED
            assert isinstance(result.error, TransactionBroken)
            assert "begin_nested" in (result.reason or "")
            assert "IntegrityError" in (result.reason or "")
        assert effects(db, ledger) == ["b1", "b3"]
    else:
        assert effects(db, ledger) == ["s0", "b1", "b2", "b3"]


def test_a_handler_that_isolates_its_failure_in_a_savepoint_is_processed(
    db: Database, flavor: Any
) -> None:
    ledger = create_ledger(db)
    taken = db.name("taken")
    with db.engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {taken} (k TEXT PRIMARY KEY)")
        conn.exec_driver_sql(f"INSERT INTO {taken} VALUES ('k')")

    def behavior(message: Message) -> list[tuple[str, dict[str, Any]]]:
        return [
            (f"{NESTED}INSERT INTO {taken} VALUES ('k')", {}),
            (f"INSERT INTO {ledger} (message_id) VALUES (:m)", {"m": message.id}),
        ]

    handle = flavor.wrap(behavior, consumer="c", retry=FAST)
    results = handle.process_batch([order("n1"), order("n2")])
    assert [r.outcome for r in results] == [Outcome.PROCESSED] * 2
    assert_invariants(db, ledger, results)


@pytest.mark.parametrize("ending", [COMMIT, ROLLBACK])
def test_a_handler_that_ends_the_transaction_fails_alone(
    db: Database, flavor: Any, ending: str
) -> None:
    ledger = create_ledger(db)

    def behavior(message: Message) -> list[tuple[str, dict[str, Any]]]:
        steps = [(f"INSERT INTO {ledger} (message_id) VALUES (:m)", {"m": message.id})]
        if message.json().get("end"):
            steps.append((ending, {}))
            steps.append((f"INSERT INTO {ledger} (message_id) VALUES (:m)", {"m": message.id}))
        return steps

    handle = flavor.wrap(behavior, consumer="c", retry=FAST)
    results = handle.process_batch([order("e1"), order("e2", end=True), order("e3")])
    assert [r.outcome for r in results] == [Outcome.PROCESSED, Outcome.FAILED, Outcome.PROCESSED]
    expected = CommitInHandler if ending == COMMIT else TransactionBroken
    assert isinstance(results[1].error, expected)
    assert effects(db, ledger) == ["e1", "e3"]
    assert_invariants(db, ledger, results)


@pytest.mark.parametrize("bad_id", ["a\x00b", "\ud800", "x" * 256, ""])
def test_an_id_the_database_cannot_store_is_refused_at_once_and_the_batch_goes_on(
    db: Database, flavor: Any, bad_id: str
) -> None:
    ledger = create_ledger(db)

    def behavior(message: Message) -> list[tuple[str, dict[str, Any]]]:
        return [(f"INSERT INTO {ledger} (message_id) VALUES (:m)", {"m": message.id})]

    handle = flavor.wrap(behavior, consumer="c", retry=FAST)
    began = time.monotonic()
    results = handle.process_batch([order("ok1"), order(bad_id), order("ok2")])
    assert time.monotonic() - began < 10
    assert [r.outcome for r in results] == [Outcome.PROCESSED, Outcome.FAILED, Outcome.PROCESSED]
    assert isinstance(results[1].error, InvalidMessage)
    assert effects(db, ledger) == ["ok1", "ok2"]
    assert set(records(db)) == {"ok1", "ok2"}


def test_a_failure_text_the_database_cannot_store_is_recorded_readably(
    db: Database, flavor: Any
) -> None:
    ledger = create_ledger(db)

    def behavior(message: Message) -> list[tuple[str, dict[str, Any]]]:
        if message.json().get("refuse"):
            raise PermanentError("bad \x00 byte and a lone \udc80 surrogate")
        return [(f"INSERT INTO {ledger} (message_id) VALUES (:m)", {"m": message.id})]

    handle = flavor.wrap(behavior, consumer="c", retry=FAST)
    results = handle.process_batch([order("f1"), order("f2", refuse=True), order("f3")])
    assert [r.outcome for r in results] == [Outcome.PROCESSED, Outcome.FAILED, Outcome.PROCESSED]
    outcome, error = records(db)["f2"]
    assert outcome == "failed"
    assert error == r"PermanentError: bad \0 byte and a lone \udc80 surrogate"
    assert_invariants(db, ledger, results)


@pytest.mark.parametrize("culprit", [0, 2, 4])
def test_a_deferred_constraint_failing_at_commit_fails_only_its_culprit(
    pg_any: Database, flavor_on: Any, culprit: int
) -> None:
    db, flavor = pg_any, flavor_on
    ledger = create_ledger(db)
    parent, child = db.name("parent"), db.name("child")
    with db.engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {parent} (id TEXT PRIMARY KEY)")
        conn.exec_driver_sql(
            f"CREATE TABLE {child} (parent TEXT REFERENCES {parent} DEFERRABLE INITIALLY DEFERRED)"
        )

    def behavior(message: Message) -> list[tuple[str, dict[str, Any]]]:
        orphan = message.json().get("orphan")
        steps = [(f"INSERT INTO {ledger} (message_id) VALUES (:m)", {"m": message.id})]
        if not orphan:
            steps.append((f"INSERT INTO {parent} VALUES (:m)", {"m": message.id}))
        steps.append((f"INSERT INTO {child} VALUES (:m)", {"m": message.id}))
        return steps

    handle = flavor.wrap(behavior, consumer="c", retry=FAST)
    messages = [order(f"d{i}", orphan=i == culprit) for i in range(5)]
    results = handle.process_batch(messages)
    expected = [Outcome.FAILED if i == culprit else Outcome.PROCESSED for i in range(5)]
    assert [r.outcome for r in results] == expected
    assert "ForeignKeyViolation" in (results[culprit].reason or "") or "foreign key" in (
        results[culprit].reason or ""
    )
    assert effects(db, ledger) == [f"d{i}" for i in range(5) if i != culprit]
    assert_invariants(db, ledger, results)


def _retrying(ledger: str, culprit: str, times: int) -> Any:
    tries: dict[str, int] = {}

    def behavior(message: Message) -> list[tuple[str, dict[str, Any]]]:
        tries[message.id] = tries.get(message.id, 0) + 1
        if message.id == culprit and tries[message.id] <= times:
            raise RetryLater("not yet")
        return [(f"INSERT INTO {ledger} (message_id) VALUES (:m)", {"m": message.id})]

    return behavior


def test_an_ordered_batch_commits_in_order_when_a_retry_recovers(db: Database, flavor: Any) -> None:
    ledger = create_ledger(db)
    handle = flavor.wrap(_retrying(ledger, "o2", times=2), consumer="c", retry=FAST)
    messages = [order(f"o{i}") for i in range(1, 6)]
    results = handle.process_batch(messages, ordered=True)
    assert [r.outcome for r in results] == [Outcome.PROCESSED] * 5
    assert effects(db, ledger) == ["o1", "o2", "o3", "o4", "o5"]


def test_an_ordered_batch_holds_back_everything_behind_a_retry(db: Database, flavor: Any) -> None:
    ledger = create_ledger(db)
    handle = flavor.wrap(_retrying(ledger, "o2", times=99), consumer="c", retry=FAST)
    messages = [order(f"o{i}") for i in range(1, 6)]
    results = handle.process_batch(messages, ordered=True)
    assert [r.outcome for r in results] == [Outcome.PROCESSED] + [Outcome.RETRY] * 4
    assert all(isinstance(r.error, HeldBack) for r in results[2:])
    assert effects(db, ledger) == ["o1"]
    assert_invariants(db, ledger, results)
    # Unordered, the others need not wait.
    again = handle.process_batch(messages)
    assert [r.outcome for r in again] == [
        Outcome.DUPLICATE,
        Outcome.RETRY,
        Outcome.PROCESSED,
        Outcome.PROCESSED,
        Outcome.PROCESSED,
    ]


@pytest.mark.parametrize("attack", ["unique", "data"])
def test_no_reason_carries_a_bound_value(
    db: Database, flavor: Any, attack: str, caplog: pytest.LogCaptureFixture
) -> None:
    cards = db.name("cards")
    with db.engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {cards} (number TEXT UNIQUE, amount INTEGER)")
        conn.exec_driver_sql(f"INSERT INTO {cards} VALUES ('{CARD}', 1)")
    if attack == "unique":
        sql, params = f"INSERT INTO {cards} VALUES (:card, 1)", {"card": CARD}
    else:  # PostgreSQL quotes the rejected input back; SQLite stores it (no error, no leak)
        sql, params = f"INSERT INTO {cards} VALUES ('x', CAST(:card AS INTEGER))", {"card": CARD}
        if db.dialect == "postgresql":
            params = {"card": f"{CARD}-"}

    def behavior(message: Message) -> list[tuple[str, dict[str, Any]]]:
        return [(sql, params)]

    dead: list[Result] = []
    caplog.set_level(logging.DEBUG, logger="consumerdedup")
    handle = flavor.wrap(behavior, consumer="c", retry=FAST, dead_letter=dead.append)
    result = handle.process(order("leak"))
    if attack == "data" and db.dialect == "sqlite":
        assert result.outcome is Outcome.PROCESSED
        return
    assert result.outcome is Outcome.FAILED
    assert dead and dead[0].reason
    ours = [r for r in caplog.records if r.name.startswith("consumerdedup")]
    logged = "\n".join(caplog.handler.format(r) for r in ours)  # with any traceback
    assert "leak" in logged
    for text in (result.reason, records(db)["leak"][1], dead[0].reason, logged):
        assert text and CARD not in text, text
        assert "[parameters" not in text


def test_a_consumer_name_the_table_cannot_hold_is_refused_at_construction(
    db: Database, flavor: Any
) -> None:
    from consumerdedup import ConfigurationError

    for name in ("c" * 256, "a\x00b", ""):
        with pytest.raises(ConfigurationError, match="consumer"):
            flavor.deduplicator(consumer=name)


@pytest.fixture(params=["postgresql", "postgresql-partitioned"])
def pg_any(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    yield from database(request, request.param, tmp_path)


@pytest.fixture(params=["sync-claim", "sync-check", "async-claim", "async-check"])
def flavor_on(request: pytest.FixtureRequest, pg_any: Database) -> Iterator[object]:
    from tests.support.flavors import AsyncFlavor, SyncFlavor

    kind, mode = request.param.split("-")
    flavor_class = SyncFlavor if kind == "sync" else AsyncFlavor
    chosen = flavor_class(pg_any, claim_first=mode == "claim")
    yield chosen
    chosen.close()


def test_a_key_that_is_never_claimed_nor_found_still_ends_in_bounded_attempts() -> None:
    """The decision logic alone, against a database that never answers a claim or a lookup:
    whatever the cause, undecided messages end RETRY once the attempt budget is spent."""
    from consumerdedup import Tables
    from consumerdedup.dedup.ops import Execute
    from consumerdedup.dedup.pipeline import Pipeline
    from consumerdedup.dedup.statements import Statements

    pipeline = Pipeline(Statements(Tables.define(), "postgresql"), "c", FAST, claim_first=True)
    batch = pipeline.start([order("x1"), order("x2")])
    rounds = 0
    while True:
        rounds += 1
        assert rounds < 1000, "the pipeline never stopped attempting"
        attempt, reply = pipeline.attempt(batch), None
        try:
            while True:
                op = attempt.send(reply)
                reply = (
                    (set() if op.read is Statements.read_recorded else {})
                    if isinstance(op, Execute)
                    else None
                )
        except StopIteration as stop:
            if not stop.value.pending:
                break
    results = pipeline.finish(batch)
    assert [r.outcome for r in results] == [Outcome.RETRY, Outcome.RETRY]
    assert "undecided after" in (results[0].reason or "")


@pytest.mark.parametrize("control", ["COMMIT", "ROLLBACK", "END"])
def test_transaction_control_sent_as_sql_by_a_handler_fails_it_alone(
    db: Database, flavor: Any, control: str
) -> None:
    ledger = create_ledger(db)

    def behavior(message: Message) -> list[tuple[str, dict[str, Any]]]:
        steps = [(f"INSERT INTO {ledger} (message_id) VALUES (:m)", {"m": message.id})]
        if message.json().get("end"):  # then it goes on writing, as if nothing happened
            steps += [(control, {}), steps[0]]
        return steps

    handle = flavor.wrap(behavior, consumer="c", retry=FAST)
    results = handle.process_batch([order("t1"), order("t2", end=True), order("t3")])
    assert [r.outcome for r in results] == [Outcome.PROCESSED, Outcome.FAILED, Outcome.PROCESSED]
    assert effects(db, ledger) == ["t1", "t3"]
    assert_invariants(db, ledger, results)
    again = handle.process_batch([order("t1"), order("t2", end=True), order("t3")])
    assert [r.outcome for r in again] == [Outcome.DUPLICATE, Outcome.FAILED, Outcome.DUPLICATE]
    assert effects(db, ledger) == ["t1", "t3"]


def test_a_connection_commit_inside_a_handler_is_refused(sqlite_db: Database) -> None:
    from sqlalchemy import text

    from consumerdedup import Deduplicator

    db = sqlite_db
    ledger = create_ledger(db)
    dedup = Deduplicator(db.engine, consumer="c", tables=db.tables, retry=FAST)

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        session.execute(text(f"INSERT INTO {ledger} (message_id) VALUES (:m)"), {"m": message.id})
        if message.json().get("commit"):
            session.connection().commit()

    results = handle.process_batch([order("c1"), order("c2", commit=True), order("c3")])
    assert [r.outcome for r in results] == [Outcome.PROCESSED, Outcome.FAILED, Outcome.PROCESSED]
    assert isinstance(results[1].error, CommitInHandler)
    assert effects(db, ledger) == ["c1", "c3"]
    assert_invariants(db, ledger, results)


def test_sqlite_rolling_back_on_conflict_then_writing_leaves_nothing(
    sqlite_db: Database,
) -> None:
    """ON CONFLICT ROLLBACK ends SQLite's transaction; statements after it would commit alone."""
    from consumerdedup import Deduplicator
    from tests.support.flavors import SyncFlavor

    db = sqlite_db
    ledger = create_ledger(db)
    with db.engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE strict (k TEXT UNIQUE ON CONFLICT ROLLBACK)")
        conn.exec_driver_sql("INSERT INTO strict VALUES ('k')")
    assert Deduplicator  # the flavor builds it

    def behavior(message: Message) -> list[tuple[str, dict[str, Any]]]:
        steps = [(f"INSERT INTO {ledger} (message_id) VALUES (:m)", {"m": message.id})]
        if message.json().get("conflict"):
            steps = [(f"{SWALLOW}INSERT INTO strict VALUES ('k')", {}), *steps]
        return steps

    handle = SyncFlavor(db).wrap(behavior, consumer="c", retry=FAST)
    results = handle.process_batch([order("r1"), order("r2", conflict=True), order("r3")])
    assert [r.outcome for r in results] == [Outcome.PROCESSED, Outcome.FAILED, Outcome.PROCESSED]
    assert effects(db, ledger) == ["r1", "r3"]
    assert_invariants(db, ledger, results)


def test_an_error_whose_text_cannot_be_read_still_fails_alone(db: Database, flavor: Any) -> None:
    ledger = create_ledger(db)

    class Unprintable(PermanentError):
        def __str__(self) -> str:
            raise RuntimeError("no text for you")

    def behavior(message: Message) -> list[tuple[str, dict[str, Any]]]:
        if message.json().get("bad"):
            raise Unprintable()
        return [(f"INSERT INTO {ledger} (message_id) VALUES (:m)", {"m": message.id})]

    handle = flavor.wrap(behavior, consumer="c", retry=FAST)
    results = handle.process_batch([order("u1"), order("u2", bad=True), order("u3")])
    assert [r.outcome for r in results] == [Outcome.PROCESSED, Outcome.FAILED, Outcome.PROCESSED]
    assert "could not be read" in (results[1].reason or "")
    assert_invariants(db, ledger, results)


def test_an_operational_error_that_always_recurs_ends_failed_not_retried_forever(
    db: Database, flavor: Any
) -> None:
    """psycopg and sqlite3 call some deterministic errors OperationalError; the code decides."""
    ledger = create_ledger(db)
    if db.dialect == "sqlite":
        poison = "SELECT json_extract('{not json', '$.a')"
    else:
        poison = "DO $$ BEGIN RAISE EXCEPTION 'too big' USING ERRCODE = '54000'; END $$"

    def behavior(message: Message) -> list[tuple[str, dict[str, Any]]]:
        steps = [(f"INSERT INTO {ledger} (message_id) VALUES (:m)", {"m": message.id})]
        return [(poison, {}), *steps] if message.json().get("bad") else steps

    handle = flavor.wrap(behavior, consumer="c", retry=FAST)
    results = handle.process_batch([order("g1"), order("g2", bad=True), order("g3")], ordered=True)
    assert [r.outcome for r in results] == [Outcome.PROCESSED, Outcome.FAILED, Outcome.PROCESSED]
    assert_invariants(db, ledger, results)


def test_a_pending_orm_write_fails_its_own_message(db: Database, flavor: Any) -> None:
    """An object added and left unflushed fails when it is flushed: right after its handler,
    not in whichever later handler happens to run a statement."""
    from sqlalchemy import Column, MetaData, String, Table, insert, text
    from sqlalchemy.orm import registry

    ledger = create_ledger(db)
    metadata = MetaData(schema=db.schema)
    strict = Table("strict_orm", metadata, Column("k", String(10), primary_key=True))
    metadata.create_all(db.engine)
    with db.engine.begin() as conn:
        conn.execute(insert(strict).values(k="taken"))

    class Strict:
        def __init__(self, k: str) -> None:
            self.k = k

    registry(metadata=metadata).map_imperatively(Strict, strict)
    write = f"INSERT INTO {ledger} (message_id) VALUES (:m)"
    dedup = flavor.deduplicator(consumer="c", retry=FAST)
    if flavor.name == "async":

        @dedup.handler(claim_first=flavor.claim_first)
        async def handle(message: Message, session: Any) -> None:
            await session.execute(text(write), {"m": message.id})
            if message.json().get("pending"):
                session.add(Strict("taken"))

        def run(messages: list[Message]) -> list[Result]:
            return flavor.loop.run_until_complete(handle.process_batch(messages))  # type: ignore[no-any-return]
    else:

        @dedup.handler(claim_first=flavor.claim_first)
        def handle(message: Message, session: Any) -> None:
            session.execute(text(write), {"m": message.id})
            if message.json().get("pending"):
                session.add(Strict("taken"))

        run = handle.process_batch
    results = run([order("p1"), order("p2", pending=True), order("p3"), order("p4")])
    expected = [Outcome.PROCESSED, Outcome.FAILED, Outcome.PROCESSED, Outcome.PROCESSED]
    assert [r.outcome for r in results] == expected
    assert [r.attempts for r in results if r.outcome is Outcome.PROCESSED] == [1, 1, 1]
    assert_invariants(db, ledger, results)


def test_a_missing_processed_events_table_is_a_configuration_error_not_dead_letters(
    db: Database, flavor: Any
) -> None:
    from consumerdedup import ConfigurationError, Tables

    ledger = create_ledger(db)
    dead: list[Result] = []
    prefix = f"{db.schema}." if db.schema else ""
    elsewhere = Tables.define(f"{prefix}nowhere_events", f"{prefix}nowhere_outbox")
    handle = flavor.wrap(
        lambda m: [(f"INSERT INTO {ledger} (message_id) VALUES (:m)", {"m": m.id})],
        consumer="c",
        retry=FAST,
        tables=elsewhere,
        dead_letter=dead.append,
    )
    with pytest.raises(ConfigurationError, match="cannot be used as configured"):
        handle.process_batch([order("m1"), order("m2")])
    assert dead == [] and effects(db, ledger) == []


def test_an_async_handler_given_to_the_blocking_deduplicator_is_refused(
    sqlite_db: Database,
) -> None:
    from consumerdedup import ConfigurationError, Deduplicator

    dedup = Deduplicator(sqlite_db.engine, consumer="c", tables=sqlite_db.tables)

    async def handler(message: Message, session: Any) -> None:
        pass

    with pytest.raises(ConfigurationError, match="AsyncDeduplicator"):
        dedup.handler(handler)


def test_many_commit_time_culprits_are_each_isolated_within_the_budget(
    pg_any: Database, flavor_on: Any
) -> None:
    db, flavor = pg_any, flavor_on
    ledger = create_ledger(db)
    once = db.name("once")
    with db.engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {once} (k TEXT UNIQUE DEFERRABLE INITIALLY DEFERRED)")
        conn.exec_driver_sql(f"INSERT INTO {once} VALUES ('taken')")

    def behavior(message: Message) -> list[tuple[str, dict[str, Any]]]:
        steps = [(f"INSERT INTO {ledger} (message_id) VALUES (:m)", {"m": message.id})]
        if message.json().get("poison"):  # fails at COMMIT only
            steps.append((f"INSERT INTO {once} VALUES ('taken')", {}))
        return steps

    handle = flavor.wrap(
        behavior,
        consumer="c",
        retry=RetryPolicy(attempts=2, initial_delay=timedelta(0), max_delay=timedelta(0)),
    )
    messages = [order(f"k{i:02}", poison=i % 2 == 1) for i in range(40)]
    results = handle.process_batch(messages)
    assert [r.outcome for r in results] == [
        Outcome.FAILED if i % 2 else Outcome.PROCESSED for i in range(40)
    ]
    assert_invariants(db, ledger, results)


SECRET = "hunter2-token"


@pytest.mark.parametrize("attack", ["quoted", "quoted-with-quotes", "raised"])
def test_no_reason_carries_a_value_the_database_quotes_back_or_raises_with(
    pg_any: Database, flavor_on: Any, attack: str, caplog: pytest.LogCaptureFixture
) -> None:
    """PostgreSQL quotes a rejected input back (``"..."``, itself holding quotes), and a
    trigger or function may raise with a bare value in its text: neither reaches a reason,
    the error column, a dead letter or a log line (invariant 6)."""
    db, flavor = pg_any, flavor_on
    refuse = db.name("refuse")
    with db.engine.begin() as conn:
        conn.exec_driver_sql(
            f"CREATE FUNCTION {refuse}(t TEXT) RETURNS INTEGER LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'card %% refused', t; END $$"
        )
    leaked = {"quoted": SECRET, "quoted-with-quotes": SECRET, "raised": CARD}[attack]
    if attack == "raised":
        sql, params = f"SELECT {refuse}(:v)", {"v": CARD}
    else:
        value = SECRET if attack == "quoted" else f'pin "{SECRET}" end'
        sql, params = "SELECT CAST(:v AS INTEGER)", {"v": value}

    def behavior(message: Message) -> list[tuple[str, dict[str, Any]]]:
        return [(sql, params)]

    dead: list[Result] = []
    caplog.set_level(logging.DEBUG, logger="consumerdedup")
    handle = flavor.wrap(behavior, consumer="c", retry=FAST, dead_letter=dead.append)
    result = handle.process(order("leak"))
    assert result.outcome is Outcome.FAILED
    assert dead and dead[0].reason
    expected = "card ... refused" if attack == "raised" else "invalid input syntax"
    assert expected in (result.reason or ""), result.reason
    ours = [r for r in caplog.records if r.name.startswith("consumerdedup")]
    logged = "\n".join(caplog.handler.format(r) for r in ours)
    assert "leak" in logged
    for text in (result.reason, records(db)["leak"][1], dead[0].reason, logged):
        assert text and leaked not in text, text


def test_a_swallowed_transient_database_error_is_retried_not_dead_lettered(
    pg_any: Database, flavor_on: Any
) -> None:
    """A handler that catches a serialization failure and goes on cannot commit; what it
    swallowed decides the class: transient, so it ends RETRY (no record, no effect), never
    FAILED. Its batch-mates commit."""
    db, flavor = pg_any, flavor_on
    ledger = create_ledger(db)
    conflict = db.name("conflict")
    with db.engine.begin() as conn:
        conn.exec_driver_sql(
            f"CREATE FUNCTION {conflict}() RETURNS INTEGER LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'could not serialize' USING ERRCODE = '40001'; END $$"
        )

    def behavior(message: Message) -> list[tuple[str, dict[str, Any]]]:
        steps = [(f"INSERT INTO {ledger} (message_id) VALUES (:m)", {"m": message.id})]
        if message.json().get("swallow"):
            steps.append((f"{SWALLOW}SELECT {conflict}()", {}))
        return steps

    handle = flavor.wrap(behavior, consumer="c", retry=FAST)
    results = handle.process_batch([order("t1"), order("t2", swallow=True), order("t3")])
    assert [r.outcome for r in results] == [Outcome.PROCESSED, Outcome.RETRY, Outcome.PROCESSED]
    assert isinstance(results[1].error, TransactionBroken)
    assert "40001" in (results[1].reason or "")
    assert "t2" not in records(db)
    assert effects(db, ledger) == ["t1", "t3"]
    assert_invariants(db, ledger, results)
