"""Issue 17, the pipeline's part: what a handler raises is its message's, and no batch stalls.

Each test checks what the database holds (the business table, processed_events)
and what the dead-letter hook heard, on both deduplicators, both claim modes
and both databases.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from consumerdedup import (
    ConfigurationError,
    Deduplicator,
    Message,
    Outbox,
    Outcome,
    Result,
    RetryPolicy,
)
from tests.conftest import Database, database

FAST = RetryPolicy(attempts=3, initial_delay=timedelta(0), max_delay=timedelta(0))


@pytest.fixture(params=["sqlite", "postgresql", "postgresql-partitioned"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    yield from database(request, request.param, tmp_path)


def order(mid: str, **data: Any) -> Message:
    return Message(id=mid, body=json.dumps({"n": 1, **data}).encode(), source="orders")


def create_ledger(db: Database) -> str:
    name = db.name("ledger")
    serial = "INTEGER PRIMARY KEY AUTOINCREMENT" if db.dialect == "sqlite" else "SERIAL PRIMARY KEY"
    with db.engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {name} (seq {serial}, message_id TEXT)")
    return name


def effects(db: Database, ledger: str) -> list[str]:
    with db.engine.connect() as conn:
        return [r[0] for r in conn.exec_driver_sql(f"SELECT message_id FROM {ledger} ORDER BY seq")]


def records(db: Database) -> dict[str, tuple[str, str | None]]:
    pe = db.tables.processed_events
    with db.engine.connect() as conn:
        return {r.message_id: (r.outcome, r.error) for r in conn.execute(pe.select())}


Work = Callable[[Message, Any], None]
"""The handler's body on a blocking session; ``awaited`` runs the same on an AsyncSession."""


def wrap(
    flavor: Any, work: Work, awaited: Callable[[Message, Any], Any], **options: Any
) -> Callable[..., list[Result]]:
    """``process_batch`` of a handler running ``work`` (sync) or ``awaited`` (async)."""
    options.setdefault("consumer", "c")
    options.setdefault("retry", FAST)
    dedup = flavor.deduplicator(**options)
    if flavor.name == "sync":
        handle = dedup.handler(claim_first=flavor.claim_first)(work)
        return handle.process_batch  # type: ignore[no-any-return]
    handle = dedup.handler(claim_first=flavor.claim_first)(awaited)

    def process_batch(messages: Sequence[Message], **kw: Any) -> list[Result]:
        return flavor.loop.run_until_complete(handle.process_batch(messages, **kw))  # type: ignore[no-any-return]

    return process_batch


def ledger_sql(ledger: str) -> str:
    return f"INSERT INTO {ledger} (message_id) VALUES (:m)"


# Item 6: a ConfigurationError a handler raises is its message's permanent failure.


def test_a_bad_argument_to_outbox_add_fails_its_message_alone(db: Database, flavor: Any) -> None:
    """The order id is an int in one message: Outbox.add refuses it with ConfigurationError.
    That message is FAILED (recorded, dead-lettered with the reason); its batch-mates commit;
    nothing is raised to the runner."""
    ledger = create_ledger(db)
    outbox = Outbox(db.tables)
    dead: list[Result] = []

    def work(message: Message, session: Any) -> None:
        session.execute(text(ledger_sql(ledger)), {"m": message.id})
        outbox.add(session, "events", b"{}", key=json.loads(message.body)["order"])

    async def awaited(message: Message, session: Any) -> None:
        await session.execute(text(ledger_sql(ledger)), {"m": message.id})
        await outbox.add(session, "events", b"{}", key=json.loads(message.body)["order"])

    process = wrap(flavor, work, awaited, dead_letter=dead.append)
    batch = [order("m1", order="o1"), order("bad", order=2), order("m3", order="o3")]
    results = process(batch)
    assert [r.outcome for r in results] == [Outcome.PROCESSED, Outcome.FAILED, Outcome.PROCESSED]
    assert "ConfigurationError" in (results[1].reason or "")
    assert "key must be None or a str" in (results[1].reason or "")
    assert effects(db, ledger) == ["m1", "m3"]
    stored = records(db)
    assert stored["bad"][0] == "failed" and "key must be None" in (stored["bad"][1] or "")
    assert [r.message.id for r in dead] == ["bad"]
    assert db.scalar(f"SELECT count(*) FROM {db.name('outbox')}") == 2
    again = process(batch)
    assert [r.outcome for r in again] == [Outcome.DUPLICATE, Outcome.FAILED, Outcome.DUPLICATE]
    assert effects(db, ledger) == ["m1", "m3"]


def test_a_handler_of_the_wrong_kind_is_still_a_setup_fault(sqlite_db: Database) -> None:
    """The other side of the line: a ConfigurationError the driver meets on its own (a
    callable that returns a coroutine, given to the blocking Deduplicator) stops the
    caller, and records nothing."""
    dedup = Deduplicator(sqlite_db.engine, consumer="c", tables=sqlite_db.tables, retry=FAST)

    class Handler:
        async def work(self, message: Message, session: Any) -> None:
            pass

        def __call__(self, message: Message, session: Any) -> Any:
            return self.work(message, session)

    handle = dedup.handler(Handler())
    with pytest.raises(ConfigurationError):
        handle.process_batch([order("m1"), order("m2")])
    assert records(sqlite_db) == {}


# Item 11: a setup fault a handler meets is never its message's permanent failure.


@pytest.mark.parametrize("missing", ["table", "column"])
def test_a_handler_writing_where_the_migration_has_not_landed_is_retried_not_failed(
    db: Database, flavor: Any, missing: str
) -> None:
    """The handler's own table (or column) does not exist yet: every message ends RETRY,
    nothing is recorded or dead-lettered; once the migration lands, the redelivery is
    processed."""
    table = db.name("later")
    if missing == "column":
        with db.engine.begin() as conn:
            conn.exec_driver_sql(f"CREATE TABLE {table} (message_id TEXT)")
    dead: list[Result] = []
    sql = f"INSERT INTO {table} (message_id, amount) VALUES (:m, 1)"
    handle = flavor.wrap(lambda m: [(sql, {"m": m.id})], consumer="c", dead_letter=dead.append)
    batch = [order(f"m{i}") for i in range(3)]
    results = handle.process_batch(batch)
    assert [r.outcome for r in results] == [Outcome.RETRY] * 3, [r.reason for r in results]
    assert records(db) == {} and dead == []
    with db.engine.begin() as conn:
        if missing == "table":
            conn.exec_driver_sql(f"CREATE TABLE {table} (message_id TEXT, amount INTEGER)")
        else:
            conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN amount INTEGER")
    again = handle.process_batch(batch)
    assert [r.outcome for r in again] == [Outcome.PROCESSED] * 3
    assert {k: v[0] for k, v in records(db).items()} == {f"m{i}": "processed" for i in range(3)}
    assert dead == []


def _real_errors(db: Database) -> dict[str, BaseException]:
    """The setup errors a handler can meet, raised by the real database."""
    import sqlalchemy

    caught: dict[str, BaseException] = {}

    def catch(name: str, engine: Any, *statements: str) -> None:
        try:
            with engine.begin() as conn:
                for statement in statements:
                    conn.exec_driver_sql(statement)
        except sqlalchemy.exc.DBAPIError as exc:
            caught[name] = exc

    table = db.name("present")
    with db.engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {table} (a INTEGER)")
    catch("no table", db.engine, f"INSERT INTO {db.name('absent')} VALUES (1)")
    catch("no column", db.engine, f"INSERT INTO {table} (b) VALUES (1)")
    if db.dialect == "postgresql":
        catch(
            "read-only", db.engine, "SET TRANSACTION READ ONLY", f"INSERT INTO {table} VALUES (1)"
        )
        role = f"cdd_{db.schema}"
        catch(
            "no rights",
            db.engine,
            f"CREATE ROLE {role}",
            f"SET LOCAL ROLE {role}",
            f"INSERT INTO {table} VALUES (1)",
        )
    else:
        url = f"file:{db.url.removeprefix('sqlite:///')}?mode=ro"
        readonly = sqlalchemy.create_engine("sqlite://", creator=lambda: _sqlite_ro(url))
        catch("read-only", readonly, f"INSERT INTO {table} VALUES (1)")
        readonly.dispose()
    return caught


def _sqlite_ro(url: str) -> Any:
    import sqlite3

    return sqlite3.connect(url, uri=True)


def test_setup_errors_from_a_handler_are_transient_and_ours_stop_the_caller(
    db: Database, tmp_path: Path
) -> None:
    """Each real setup error (42P01, 42703, 25006, 42501; SQLite's no such table / column,
    read-only database) is transient when a handler meets it, and, but for SQLite's
    read-only file (its lock or disk: retried), a ConfigurationError when ours do."""
    from consumerdedup.dedup.statements import Statements
    from consumerdedup.retry import ErrorKind

    caught = _real_errors(db)
    expected = {"no table", "no column", "read-only"} | (
        {"no rights"} if db.dialect == "postgresql" else set()
    )
    assert set(caught) == expected
    for name, error in caught.items():
        assert RetryPolicy().classify(error) is ErrorKind.TRANSIENT, (name, error)
        if not (db.dialect == "sqlite" and name == "read-only"):
            assert isinstance(Statements.misconfigured(error), ConfigurationError), name


# Item 12: the retry budget does not grow with the batch.


def test_an_outage_costs_one_messages_attempts_not_the_whole_batchs(
    db: Database, flavor: Any
) -> None:
    """Every handler raises TimeoutError (a dependency is down): the first message uses up
    its attempts, the next one fails once, and the rest of the 100 are not tried."""
    calls: list[str] = []

    def behavior(message: Message) -> list[tuple[str, dict[str, Any]]]:
        calls.append(message.id)
        raise TimeoutError("the payments API did not answer")

    policy = RetryPolicy(attempts=4, initial_delay=timedelta(0), max_delay=timedelta(0))
    dead: list[Result] = []
    handle = flavor.wrap(behavior, consumer="c", retry=policy, dead_letter=dead.append)
    results = handle.process_batch([order(f"m{i}") for i in range(100)])
    assert [r.outcome for r in results] == [Outcome.RETRY] * 100
    assert len(calls) == policy.attempts + 1, f"{len(calls)} handler calls for one outage"
    assert records(db) == {} and dead == []
    assert "TimeoutError" in (results[0].reason or "")
    assert "not tried" in (results[99].reason or "")


def test_after_an_outage_used_up_the_attempts_what_precedes_the_next_failure_commits(
    db: Database, flavor: Any
) -> None:
    ledger = create_ledger(db)
    calls: list[str] = []

    def behavior(message: Message) -> list[tuple[str, dict[str, Any]]]:
        calls.append(message.id)
        if message.id.startswith("t"):
            raise TimeoutError("down")
        return [(ledger_sql(ledger), {"m": message.id})]

    handle = flavor.wrap(behavior, consumer="c", retry=FAST)
    names = ["t0", "ok1", "ok2", "t3", "ok4"]
    results = handle.process_batch([order(n) for n in names])
    assert [r.outcome for r in results] == [
        Outcome.RETRY,
        Outcome.PROCESSED,
        Outcome.PROCESSED,
        Outcome.RETRY,
        Outcome.RETRY,
    ]
    assert effects(db, ledger) == ["ok1", "ok2"]
    assert calls.count("t0") == FAST.attempts and calls.count("t3") == 1
    assert "ok4" not in calls
    assert set(records(db)) == {"ok1", "ok2"}


# Item 13 (a): on an ordered source, nothing behind the first RETRY is reported decided.


def handle_of(
    flavor: Any, work: Work, awaited: Callable[[Message, Any], Any], **options: Any
) -> Any:
    options.setdefault("consumer", "c")
    options.setdefault("retry", FAST)
    dedup = flavor.deduplicator(**options)
    return dedup.handler(claim_first=flavor.claim_first)(work if flavor.name == "sync" else awaited)


def drive(flavor: Any, handle: Any, delivered: list[tuple[Message, str | None]]) -> list[Result]:
    """The runners' way in: the blocking processor for a blocking handler, the asyncio one
    for an asyncio handler; ordered, as the Kafka runner calls it for a partition's chunk."""
    from consumerdedup.dedup.processing import AsyncProcessor, BlockingProcessor

    if flavor.name == "sync":
        processor = BlockingProcessor(handle)
        try:
            return processor.process(delivered, ordered=True)
        finally:
            processor.close()
    processing = AsyncProcessor(handle).process(delivered, ordered=True)
    return flavor.loop.run_until_complete(processing)  # type: ignore[no-any-return]


def test_a_refused_delivery_behind_a_retry_is_held_back_not_dead_lettered_again(
    db: Database, flavor: Any
) -> None:
    """m1 is to be retried; the malformed delivery behind it will be read again after it,
    so refusing it now would dead-letter (and count) it once per re-read."""
    from consumerdedup.errors import HeldBack, RetryLater

    ledger = create_ledger(db)

    def work(message: Message, session: Any) -> None:
        if message.id == "m1":
            raise RetryLater("not yet")
        session.execute(text(ledger_sql(ledger)), {"m": message.id})

    async def awaited(message: Message, session: Any) -> None:
        if message.id == "m1":
            raise RetryLater("not yet")
        await session.execute(text(ledger_sql(ledger)), {"m": message.id})

    dead: list[Result] = []
    handle = handle_of(flavor, work, awaited, dead_letter=dead.append)
    delivered = [
        (order("m0"), None),
        (order("m1"), None),
        (order("bad"), "a header that is not bytes"),
        (order("m3"), None),
    ]
    for _reread in range(2):
        results = drive(flavor, handle, delivered)
        outcomes = [r.outcome for r in results]
        assert outcomes[1:] == [Outcome.RETRY] * 3, [(r.outcome, r.reason) for r in results]
        assert isinstance(results[2].error, HeldBack) and isinstance(results[3].error, HeldBack)
    assert dead == [] and handle.dedup.counts[Outcome.FAILED] == 0
    assert effects(db, ledger) == ["m0"]
    # Ahead of the retry, a refusal is dead-lettered in its place as before.
    results = drive(
        flavor, handle, [(order("bad0"), "a header that is not bytes"), (order("m1"), None)]
    )
    assert [r.outcome for r in results] == [Outcome.FAILED, Outcome.RETRY]
    assert [r.message.id for r in dead] == ["bad0"]


def test_an_unusable_id_behind_a_retry_in_an_ordered_batch_is_held_back(
    db: Database, flavor: Any
) -> None:
    from consumerdedup.errors import HeldBack

    dead: list[Result] = []
    handle = flavor.wrap(
        lambda m: (_ for _ in ()).throw(TimeoutError("down")),
        consumer="c",
        retry=FAST,
        dead_letter=dead.append,
    )
    batch = [order("m1"), Message(id="", body=b"{}"), order("m3")]
    results = handle.process_batch(batch, ordered=True)
    assert [r.outcome for r in results] == [Outcome.RETRY] * 3, [r.reason for r in results]
    assert isinstance(results[1].error, HeldBack)
    assert dead == [] and records(db) == {}


def test_an_ordered_batch_commits_nothing_behind_a_key_neither_claimed_nor_found() -> None:
    """The decision logic alone: the claim returns x2 but not x1, and the lookup finds no x1
    (a twin's commit the snapshot missed). x1 is undecided, so x2 behind it must not commit
    before it: every attempt rolls back, and the budget ends both RETRY."""
    from consumerdedup import Tables
    from consumerdedup.dedup.ops import CallHandler, Commit, Execute
    from consumerdedup.dedup.pipeline import Pipeline
    from consumerdedup.dedup.statements import Statements

    pipeline = Pipeline(Statements(Tables.define(), "postgresql"), "c", FAST, claim_first=True)
    batch = pipeline.start([order("x1"), order("x2")], ordered=True)
    committed_after_handler = 0
    for _round in range(1000):
        attempt, reply, handled = pipeline.attempt(batch), None, False
        try:
            while True:
                op = attempt.send(reply)
                reply = None
                if isinstance(op, Execute):
                    reply = {"x2"} if op.read is Statements.read_recorded else {}
                handled = handled or isinstance(op, CallHandler)
                committed_after_handler += isinstance(op, Commit) and handled
        except StopIteration as stop:
            if not stop.value.pending:
                break
    results = pipeline.finish(batch)
    assert committed_after_handler == 0, "x2 committed behind the undecided x1"
    assert [r.outcome for r in results] == [Outcome.RETRY, Outcome.RETRY]
