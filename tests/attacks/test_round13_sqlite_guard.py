"""Round 13 attacks on the SQLite handler guard (commit 8ddd578: sqlite3's authorizer
denies COMMIT, and a ROLLBACK or a BEGIN seen while the guard is on ends the call's
transaction), through the public API, on SQLite files (sqlite3 and aiosqlite).

False alarms: legitimate handlers (savepoints, reads only, bulk, keyed outbox, check-first,
SQLAlchemy's pysqlite recipe, StaticPool, batches of 500, the memory runner with
redeliveries) must still end PROCESSED with their effects exactly once. Holes: ways to end
the transaction that the authorizer does not see. Each test ends on the business rows (a
ledger without unique key) and the processed_events records.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import Engine
from sqlalchemy.pool import StaticPool

from consumerdedup import (
    AsyncDeduplicator,
    Deduplicator,
    Message,
    Outbox,
    Outcome,
    RetryPolicy,
    driver_connection,
    install,
)
from consumerdedup.errors import SimulatedCrash
from consumerdedup.testing import MemoryBroker, MemoryConfig, MemoryConsumerRunner
from tests.conftest import Database

FAST_RETRY = RetryPolicy(attempts=3, initial_delay=timedelta(milliseconds=1))


def msgs(*ids: str) -> list[Message]:
    return [Message(id=i, body=b"x") for i in ids]


def shaped(dedup: Any, shape: str, one: Any) -> Any:
    """``one(message, session)`` as a per-message handler, claim-first or check-first, or
    called for each message of a bulk handler's call ("bulk")."""
    if shape != "bulk":
        return dedup.handler(claim_first=shape == "claim-first")(one)

    @dedup.bulk_handler
    def handle(messages: list[Message], session: Any) -> None:
        for message in messages:
            one(message, session)

    return handle


def ledger_ids(engine: Engine, ledger: str) -> list[str]:
    with engine.connect() as conn:
        return sorted(r[0] for r in conn.execute(text(f"SELECT message_id FROM {ledger}")))


def records(engine: Engine, table: str = "processed_events") -> dict[str, str]:
    with engine.connect() as conn:
        rows = conn.execute(text(f"SELECT message_id, outcome FROM {table}"))
        return {r[0]: r[1] for r in rows}


def exactly_once(engine: Engine, ledger: str, results: list[Any], per: int = 1) -> None:
    """Every message PROCESSED, its ``per`` rows there once each, its record 'processed'."""
    got = ledger_ids(engine, ledger)
    recs = records(engine)
    for result in results:
        mid = result.message.id
        assert result.outcome is Outcome.PROCESSED, (mid, result.outcome, result.error)
        assert got.count(mid) == per, (mid, got.count(mid))
        assert recs.get(mid) == "processed", (mid, recs.get(mid))


def consistent(engine: Engine, ledger: str, results: list[Any]) -> None:
    """Each PROCESSED message has its row exactly once; every other none."""
    got = ledger_ids(engine, ledger)
    recs = records(engine)
    for result in results:
        mid = result.message.id
        if result.outcome is Outcome.PROCESSED:
            assert got.count(mid) == 1, (mid, got, recs)
            assert recs.get(mid) == "processed", (mid, recs)
        else:
            assert got.count(mid) == 0, (mid, got, recs, result.outcome)


def make_ledger(engine: Engine) -> str:
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE ledger (account VARCHAR(64), message_id TEXT)"))
    return "ledger"


def insert(session: Any, mid: str, account: str = "a") -> None:
    session.execute(
        text("INSERT INTO ledger (account, message_id) VALUES (:a, :m)"), {"a": account, "m": mid}
    )


# --- False alarms: legitimate handlers ------------------------------------------------


def savepoints(message: Message, session: Any) -> None:
    """A committed savepoint, a rolled-back one, and one nested in a committed one whose
    inner savepoint rolls back: one ledger row a message in the end."""
    with session.begin_nested():
        insert(session, message.id or "")
    with contextlib.suppress(RuntimeError), session.begin_nested():
        insert(session, message.id or "", "rolled-back")
        raise RuntimeError("undo")
    with session.begin_nested():
        with contextlib.suppress(RuntimeError), session.begin_nested():
            insert(session, message.id or "", "inner-rolled-back")
            raise RuntimeError("undo")
        session.execute(text("SELECT count(*) FROM ledger")).scalar()


def raw_savepoints(message: Message, session: Any) -> None:
    """The same through the raw sqlite3 connection: SAVEPOINT / ROLLBACK TO / RELEASE."""
    raw = driver_connection(session)
    raw.execute("SAVEPOINT a")
    raw.execute("INSERT INTO ledger (account, message_id) VALUES ('x', ?)", (message.id,))
    raw.execute("ROLLBACK TO SAVEPOINT a")
    raw.execute("RELEASE SAVEPOINT a")
    raw.execute("SAVEPOINT b")
    raw.execute("INSERT INTO ledger (account, message_id) VALUES ('a', ?)", (message.id,))
    raw.execute("RELEASE b")


def reads_then_writes(message: Message, session: Any) -> None:
    session.execute(text("SELECT count(*) FROM ledger")).scalar()
    driver_connection(session).execute("SELECT 1").fetchall()
    insert(session, message.id or "")


def with_outbox(message: Message, session: Any) -> None:
    insert(session, message.id or "")
    Outbox().add(session, "out", b"{}", key=f"k-{message.id}")


LEGIT = {
    "savepoints": savepoints,
    "raw-savepoints": raw_savepoints,
    "reads-then-writes": reads_then_writes,
    "keyed-outbox": with_outbox,
}


@pytest.mark.parametrize("body", list(LEGIT))
@pytest.mark.parametrize("shape", ["claim-first", "check-first", "bulk"])
def test_legitimate_handlers_still_process(sqlite_db: Database, body: str, shape: str) -> None:
    engine = sqlite_db.engine
    make_ledger(engine)
    dedup = Deduplicator(engine, consumer="c", tables=sqlite_db.tables, retry=FAST_RETRY)
    one = LEGIT[body]
    handle = shaped(dedup, shape, one)

    results = handle.process_batch(msgs("m1", "m2", "m3"))
    exactly_once(engine, "ledger", results)
    again = handle.process_batch(msgs("m1", "m2", "m3"))
    assert [r.outcome for r in again] == [Outcome.DUPLICATE] * 3
    exactly_once(engine, "ledger", results)
    if body == "keyed-outbox":
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM outbox")).scalar() == 3


def pysqlite_recipe(path: Path) -> Engine:
    """SQLAlchemy's documented recipe: the driver's own transaction handling off, BEGIN
    emitted by SQLAlchemy's ``begin`` event."""
    engine = create_engine(f"sqlite:///{path}")

    @event.listens_for(engine, "connect")
    def do_connect(dbapi_connection: Any, connection_record: Any) -> None:
        dbapi_connection.isolation_level = None

    @event.listens_for(engine, "begin")
    def do_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN")

    return engine


def static_memory(path: Path) -> Engine:
    return create_engine(
        "sqlite://", poolclass=StaticPool, connect_args={"check_same_thread": False}
    )


@pytest.fixture(params=["pysqlite-recipe", "static-memory"])
def odd_engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    maker = pysqlite_recipe if request.param == "pysqlite-recipe" else static_memory
    engine = maker(tmp_path / "odd.db")
    install(engine)
    make_ledger(engine)
    yield engine
    engine.dispose()


@pytest.mark.parametrize("claim_first", [True, False])
def test_odd_engines_process_with_savepoints_and_a_failing_message(
    odd_engine: Engine, claim_first: bool
) -> None:
    """A batch where one message's handler raises once (the pipeline rolls back and goes
    on) and the others use savepoints: each ends PROCESSED once, the raiser too on retry."""
    dedup = Deduplicator(odd_engine, consumer="c", retry=FAST_RETRY)
    raised: list[str] = []

    @dedup.handler(claim_first=claim_first)
    def handle(message: Message, session: Any) -> None:
        savepoints(message, session)
        if message.id == "m2" and not raised:
            raised.append("x")
            raise RuntimeError("transient")

    results = handle.process_batch(msgs("m1", "m2", "m3"))
    assert raised == ["x"]
    exactly_once(odd_engine, "ledger", results)


def test_batch_of_500_bulk_and_per_message(sqlite_db: Database) -> None:
    engine = sqlite_db.engine
    make_ledger(engine)
    dedup = Deduplicator(engine, consumer="c", tables=sqlite_db.tables)

    @dedup.bulk_handler
    def bulk(messages: list[Message], session: Any) -> None:
        driver_connection(session).executemany(
            "INSERT INTO ledger (account, message_id) VALUES ('b', ?)",
            [(m.id,) for m in messages],
        )

    @dedup.handler(claim_first=False)
    def each(message: Message, session: Any) -> None:
        insert(session, message.id or "")

    first = bulk.process_batch(msgs(*(f"b{i}" for i in range(500))))
    exactly_once(engine, "ledger", first)
    second = each.process_batch(msgs(*(f"e{i}" for i in range(500))))
    exactly_once(engine, "ledger", second)


def test_memory_runner_with_redeliveries(sqlite_db: Database) -> None:
    """The consumer crashes before its first ack: the whole batch comes back, and is
    reported DUPLICATE; each effect once."""
    engine = sqlite_db.engine
    make_ledger(engine)
    dedup = Deduplicator(engine, consumer="c", tables=sqlite_db.tables, retry=FAST_RETRY)

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        savepoints(message, session)

    broker = MemoryBroker()
    for i in range(20):
        broker.publish("q", b"{}", message_id=f"r{i}")
    broker.crash_before_ack(lambda delivery: True)
    config = MemoryConfig(batch_size=7, retry_delay=timedelta(milliseconds=1))
    runner = MemoryConsumerRunner(handle, "q", broker=broker, config=config)
    with pytest.raises(SimulatedCrash):
        runner.run(until_idle=True)
    assert broker.crashes_injected == 1
    again = MemoryConsumerRunner(handle, "q", broker=broker, config=config)
    again.run(until_idle=True)
    assert again.outcomes[Outcome.DUPLICATE] == 7, again.outcomes
    assert again.outcomes[Outcome.PROCESSED] == 13, again.outcomes
    assert ledger_ids(engine, "ledger") == sorted(f"r{i}" for i in range(20))
    recs = records(engine)
    assert all(recs.get(f"r{i}") == "processed" for i in range(20)), recs


def test_async_aiosqlite_savepoints_and_outbox(sqlite_db: Database) -> None:
    async def run() -> list[Any]:
        dedup = AsyncDeduplicator(sqlite_db.async_engine(), consumer="c", tables=sqlite_db.tables)

        @dedup.handler
        async def handle(message: Message, session: Any) -> None:
            async with session.begin_nested():
                await session.execute(
                    text("INSERT INTO ledger (account, message_id) VALUES ('a', :m)"),
                    {"m": message.id},
                )
            with contextlib.suppress(RuntimeError):
                async with session.begin_nested():
                    await session.execute(
                        text("INSERT INTO ledger (account, message_id) VALUES ('x', :m)"),
                        {"m": message.id},
                    )
                    raise RuntimeError("undo")
            await Outbox().add(session, "out", b"{}", key=f"k-{message.id}")

        try:
            return list(await handle.process_batch(msgs("m1", "m2", "m3")))
        finally:
            await dedup.engine.dispose()

    make_ledger(sqlite_db.engine)
    results = asyncio.run(run())
    exactly_once(sqlite_db.engine, "ledger", results)


# --- Ways to end the transaction that the guard does catch --------------------------


def hostile(raw: Any, session: Any, what: str, path: str) -> None:
    if what == "exec_driver_sql-ROLLBACK":
        session.connection().exec_driver_sql("ROLLBACK")
    elif what == "function-calls-back":
        raw.create_function("undo", 0, lambda: raw.execute("ROLLBACK") and 1)
        raw.execute("SELECT undo()").fetchall()
    elif what == "cached-ROLLBACK-twice":
        for _ in range(2):
            with contextlib.suppress(Exception):
                raw.execute("ROLLBACK")
            raw.execute("INSERT INTO ledger (account, message_id) VALUES ('x', 'x')")
    elif what == "or-rollback-twice":
        for _ in range(2):
            unseen_rollback(raw)
            raw.execute("INSERT INTO ledger (account, message_id) VALUES ('x', 'x')")
    elif what == "pragma-journal-mode":
        raw.execute("PRAGMA journal_mode=DELETE").fetchall()
    elif what == "attach":
        raw.execute("ATTACH DATABASE ? AS other", (path + ".other",))
    elif what == "vacuum":
        raw.execute("VACUUM")
    elif what == "close":
        raw.close()
    elif what == "isolation_level-None":
        raw.isolation_level = None
        raw.execute("INSERT INTO ledger (account, message_id) VALUES ('x', 'x')")


HOSTILE = [
    "exec_driver_sql-ROLLBACK",
    "function-calls-back",
    "cached-ROLLBACK-twice",
    "or-rollback-twice",
    "pragma-journal-mode",
    "attach",
    "vacuum",
    "close",
    "isolation_level-None",
]


@pytest.mark.parametrize("what", HOSTILE)
@pytest.mark.parametrize("shape", ["claim-first", "check-first", "bulk"])
def test_hostile_acts_swallowed_mid_batch(sqlite_db: Database, shape: str, what: str) -> None:
    """m2 does ``what`` on the raw connection and swallows any error, then writes again:
    each message's row once with PROCESSED, or none; a redelivery changes nothing."""
    engine = sqlite_db.engine
    make_ledger(engine)
    dedup = Deduplicator(engine, consumer="c", tables=sqlite_db.tables, retry=FAST_RETRY)
    path = str(engine.url.database)
    done: list[str] = []

    def one(message: Message, session: Any) -> None:
        raw = driver_connection(session)
        insert(session, message.id or "")
        if message.id == "m2" and not done:
            done.append("x")
            with contextlib.suppress(Exception):
                hostile(raw, session, what, path)
            with contextlib.suppress(Exception):
                insert(session, "m2-after")

    handle = shaped(dedup, shape, one)

    results = handle.process_batch(msgs("m1", "m2", "m3"))
    assert "x" not in ledger_ids(engine, "ledger")
    consistent(engine, "ledger", results)
    again = handle.process_batch(msgs("m1", "m2", "m3"))
    consistent(engine, "ledger", results)
    assert all(r.outcome is not Outcome.PROCESSED for r in again) or all(
        r.outcome is not Outcome.PROCESSED for r in results
    )


# --- Holes: the transaction ended where the authorizer does not look -------------------


def unseen_rollback(raw: Any, how: str = "or-rollback") -> None:
    """An ``INSERT OR ROLLBACK`` conflict, or a trigger's ``RAISE(ROLLBACK)``, swallowed:
    SQLite rolls the whole transaction back with no TRANSACTION action for the authorizer
    to see (only a BEGIN sqlite3 sends later at an INSERT/UPDATE/DELETE/REPLACE shows it)."""
    if how == "or-rollback":
        raw.execute("CREATE TEMP TABLE IF NOT EXISTS u (k INTEGER UNIQUE)")
        raw.execute("INSERT OR IGNORE INTO u VALUES (1)")
        with contextlib.suppress(Exception):
            raw.execute("INSERT OR ROLLBACK INTO u VALUES (1)")
        return
    raw.execute("CREATE TEMP TABLE IF NOT EXISTS t (k INTEGER)")
    raw.execute(
        "CREATE TEMP TRIGGER IF NOT EXISTS t_undo BEFORE INSERT ON t "
        "BEGIN SELECT RAISE(ROLLBACK, 'undo'); END"
    )
    with contextlib.suppress(Exception):
        raw.execute("INSERT INTO t VALUES (1)")


def cte_write(raw: Any, mid: str) -> None:
    """A write sqlite3 does not take for DML (it starts with WITH): no implicit BEGIN, so
    outside a transaction it commits by itself."""
    raw.execute(
        "WITH v(m) AS (SELECT ?) INSERT INTO ledger (account, message_id) SELECT 'a', m FROM v",
        (mid,),
    )


@pytest.mark.parametrize("shape", ["claim-first", "check-first", "bulk"])
def test_or_rollback_then_a_cte_write_commits_alone(sqlite_db: Database, shape: str) -> None:
    engine = sqlite_db.engine
    make_ledger(engine)
    dedup = Deduplicator(engine, consumer="c", tables=sqlite_db.tables, retry=FAST_RETRY)

    def one(message: Message, session: Any) -> None:
        raw = driver_connection(session)
        insert(session, message.id or "", "first")
        if message.id == "m2":
            unseen_rollback(raw)
            cte_write(raw, "m2")
        else:
            cte_write(raw, message.id or "")

    handle = shaped(dedup, shape, one)

    results = handle.process_batch(msgs("m1", "m2", "m3"))
    assert results[1].outcome is not Outcome.PROCESSED
    assert "m2" not in ledger_ids(engine, "ledger")


def savepoint_begun(how: str) -> Any:
    """m2: an unseen rollback, then a SAVEPOINT, which outside a transaction begins one
    (the authorizer sees a SAVEPOINT action, not a BEGIN), then a write as usual."""

    def one(message: Message, session: Any) -> None:
        raw = driver_connection(session)
        insert(session, message.id or "")
        if message.id == "m2":
            unseen_rollback(raw, how)
            raw.execute("SAVEPOINT s")
            insert(session, "m2")

    return one


@pytest.mark.parametrize("how", ["or-rollback", "trigger-raise"])
@pytest.mark.parametrize("shape", ["claim-first", "check-first", "bulk"])
def test_unseen_rollback_then_a_savepoint_begins_anew(
    sqlite_db: Database, shape: str, how: str
) -> None:
    engine = sqlite_db.engine
    make_ledger(engine)
    dedup = Deduplicator(engine, consumer="c", tables=sqlite_db.tables, retry=FAST_RETRY)
    one = savepoint_begun(how)
    handle = shaped(dedup, shape, one)

    results = handle.process_batch(msgs("m1", "m2", "m3"))
    again = handle.process_batch(msgs("m1", "m2", "m3"))
    consistent(engine, "ledger", results)
    consistent(engine, "ledger", [r for r in again if r.outcome is Outcome.PROCESSED])


def test_unseen_rollback_then_a_savepoint_on_aiosqlite(sqlite_db: Database) -> None:
    async def run() -> list[Any]:
        dedup = AsyncDeduplicator(sqlite_db.async_engine(), consumer="c", tables=sqlite_db.tables)

        @dedup.handler
        async def handle(message: Message, session: Any) -> None:
            await session.execute(
                text("INSERT INTO ledger (account, message_id) VALUES ('a', :m)"),
                {"m": message.id},
            )
            if message.id == "m2":
                raw = driver_connection(session)
                for sql in (
                    "CREATE TEMP TABLE IF NOT EXISTS u (k INTEGER UNIQUE)",
                    "INSERT OR IGNORE INTO u VALUES (1)",
                ):
                    await raw.execute(sql)
                with contextlib.suppress(Exception):
                    await raw.execute("INSERT OR ROLLBACK INTO u VALUES (1)")
                await raw.execute("SAVEPOINT s")
                await session.execute(
                    text("INSERT INTO ledger (account, message_id) VALUES ('a', 'm2')")
                )

        try:
            return list(await handle.process_batch(msgs("m1", "m2", "m3")))
        finally:
            await dedup.engine.dispose()

    make_ledger(sqlite_db.engine)
    results = asyncio.run(run())
    consistent(sqlite_db.engine, "ledger", results)


@pytest.mark.xfail(
    strict=True,
    reason="SQLite guard hole left: a statement sqlite3 does not take for DML (WITH ... "
    "INSERT), prepared earlier in the transaction and run again from sqlite3's statement "
    "cache after an unseen rollback (a conflict table made before the batch: no schema "
    "change expires the cache), is not seen by the authorizer (it sees statements as they "
    "are prepared) and commits alone in autocommit, once per attempt; the call fails",
)
def test_a_cached_cte_write_after_an_unseen_rollback_commits_alone(sqlite_db: Database) -> None:
    engine = sqlite_db.engine
    make_ledger(engine)
    with engine.begin() as conn:  # before the batch: nothing in it changes the schema
        conn.exec_driver_sql("CREATE TABLE u (k INTEGER UNIQUE)")
        conn.exec_driver_sql("INSERT INTO u VALUES (1)")
    dedup = Deduplicator(engine, consumer="c", tables=sqlite_db.tables, retry=FAST_RETRY)

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        raw = driver_connection(session)
        cte_write(raw, (message.id or "") + "-first")  # prepared here, then cached
        if message.id == "m2":
            with contextlib.suppress(Exception):
                raw.execute("INSERT OR ROLLBACK INTO u VALUES (1)")
            cte_write(raw, "m2")  # from the cache: no authorizer call

    results = handle.process_batch(msgs("m1", "m2", "m3"))
    assert results[1].outcome is not Outcome.PROCESSED
    assert "m2" not in ledger_ids(engine, "ledger")
