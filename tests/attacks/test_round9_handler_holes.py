"""Round 9 (issue 38 item 15): holes the suite marked xfail, closed (or refused) here.

- A handler's ROLLBACK TO a savepoint a batch-mate's handler left open: refused before
  it is sent (dedup/call_savepoints.py), on both drivers and both dialects; the
  batch-mate keeps its effects and is PROCESSED.
- The pipeline's COMMIT finding no transaction (a thread of the handler rolled the raw
  connection back in between): the server's warning is read, the message is not
  reported PROCESSED (dedup/verified_commit.py).
- A cursor made in a handler call, used after that call (a thread, a task): refused.

Real PostgreSQL (and SQLite where it applies), through the public API.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text

from consumerdedup import AsyncDeduplicator, Deduplicator, Message, Outcome, Result, RetryPolicy
from tests.attacks.test_round6 import assert_nothing_done_without_effects, effects, recorded
from tests.conftest import Database
from tests.support.async_drivers import ASYNC_PG_DRIVERS, async_engine

FAST = RetryPolicy(attempts=2, initial_delay=timedelta(0), max_delay=timedelta(0))


@pytest.fixture
def ledger(db: Database) -> Database:
    with db.engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {db.name('ledger')} (mid TEXT)"))
    return db


@pytest.fixture
def pg_ledger(pg: Database) -> Database:
    with pg.engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {pg.name('ledger')} (mid TEXT)"))
    return pg


@pytest.fixture
def one(pg_ledger: Database) -> Iterator[Engine]:
    """A pool of one connection: every checkout gets the same one."""
    engine = create_engine(pg_ledger.url, pool_size=1, max_overflow=0, pool_timeout=30)
    yield engine
    engine.dispose()


def msgs(*ids: str) -> list[Message]:
    return [Message(id=i, body=b"{}") for i in ids]


def outcomes(results: list[Result]) -> list[Outcome]:
    return [r.outcome for r in results]


# A batch-mate's savepoint ---------------------------------------------------------------------


@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
def test_a_savepoint_left_open_cannot_be_rolled_back_to_by_the_next_handler(
    ledger: Database, claim_first: bool
) -> None:
    """SQL text through the session (SQLAlchemy's cursor events on SQLite, the watched
    psycopg cursors on PostgreSQL): m1's ROLLBACK TO m0's savepoint is refused."""
    dedup = Deduplicator(ledger.engine, "round9", tables=ledger.tables, retry=FAST)
    insert = text(f"INSERT INTO {ledger.name('ledger')} VALUES (:m)")

    @dedup.handler(claim_first=claim_first)
    def handle(message: Message, session: Any) -> None:
        if message.id == "m0":
            session.execute(text("SAVEPOINT keep"))  # never released
        session.execute(insert, {"m": message.id})
        if message.id == "m1":
            session.execute(text("ROLLBACK TO SAVEPOINT keep"))

    batch = msgs("m0", "m1", "m2")
    first = handle.process_batch(batch)
    again = handle.process_batch(batch)
    assert outcomes(first) == [Outcome.PROCESSED, Outcome.FAILED, Outcome.PROCESSED]
    assert "did not open in this call" in (first[1].reason or ""), first[1].reason
    assert_nothing_done_without_effects(ledger, first + again)
    assert sorted(effects(ledger)) == ["m0", "m2"]


def test_a_handlers_own_savepoints_still_work_in_a_batch(ledger: Database) -> None:
    """What stays allowed: a handler rolling back to its own savepoint (the latest of that
    name), after a batch-mate left one of the same name open."""
    dedup = Deduplicator(ledger.engine, "round9", tables=ledger.tables, retry=FAST)
    insert = text(f"INSERT INTO {ledger.name('ledger')} VALUES (:m)")

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        session.execute(text("SAVEPOINT keep"))  # each leaves its own open
        session.execute(insert, {"m": f"{message.id}-undone"})
        session.execute(text("ROLLBACK TO SAVEPOINT keep"))
        session.execute(insert, {"m": message.id})
        with session.begin_nested():
            session.execute(insert, {"m": f"{message.id}-nested"})

    first = handle.process_batch(msgs("m0", "m1", "m2"))
    assert outcomes(first) == [Outcome.PROCESSED] * 3, [r.reason for r in first]
    assert sorted(effects(ledger)) == sorted(
        ["m0", "m1", "m2", "m0-nested", "m1-nested", "m2-nested"]
    )


@pytest.mark.parametrize("driver", ASYNC_PG_DRIVERS)
@pytest.mark.parametrize("route", ["raw", "begin_nested"])
@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
def test_a_batch_mates_savepoint_is_not_reachable_async(
    pg_ledger: Database, route: str, claim_first: bool, driver: str
) -> None:
    insert = text(f"INSERT INTO {pg_ledger.name('ledger')} VALUES (:m)")
    kept: dict[str, Any] = {}

    async def go() -> tuple[list[Result], list[Result]]:
        engine = async_engine(pg_ledger.url, driver, pool_size=1, max_overflow=0)
        dedup = AsyncDeduplicator(engine, "round9", tables=pg_ledger.tables, retry=FAST)

        @dedup.handler(claim_first=claim_first)
        async def handle(message: Message, session: Any) -> None:
            conn = await session.connection()
            raw = conn.sync_connection.connection.driver_connection
            if message.id == "m0":
                if route == "raw":
                    await raw.execute("SAVEPOINT keep")
                else:
                    kept["sp"] = await session.begin_nested()
            elif message.id == "m1":
                if route == "raw":
                    await raw.execute("ROLLBACK TO SAVEPOINT keep")
                else:
                    await kept["sp"].rollback()
            await session.execute(insert, {"m": message.id})

        batch = msgs("m0", "m1", "m2")
        try:
            return await handle.process_batch(batch), await handle.process_batch(batch)
        finally:
            await engine.dispose()

    first, again = asyncio.run(go())
    assert_nothing_done_without_effects(pg_ledger, first + again)
    assert outcomes(first)[0] is Outcome.PROCESSED and outcomes(first)[2] is Outcome.PROCESSED
    assert outcomes(first)[1] is not Outcome.PROCESSED or "m1" in effects(pg_ledger)
    assert {"m0", "m2"} <= set(effects(pg_ledger))
    assert recorded(pg_ledger)["m0"] == "processed"


@pytest.mark.parametrize(
    ("sql", "dialect", "steps"),
    [
        ("SAVEPOINT keep", "postgresql", (("SAVEPOINT", "keep"),)),
        ('rollback work to "Keep"', "postgresql", (("ROLLBACK TO", "Keep"),)),
        ("ROLLBACK TO SAVEPOINT KEEP", "postgresql", (("ROLLBACK TO", "keep"),)),
        (
            'RELEASE keep; SAVEPOINT "a""b"',
            "postgresql",
            (("RELEASE", "keep"), ("SAVEPOINT", 'a"b')),
        ),
        ("SELECT 'x;ROLLBACK TO a'", "postgresql", ()),
        ("SELECT '\\';ROLLBACK TO a; --'", "postgresql", (("ROLLBACK TO", None),)),
        (
            "SAVEPOINT [Keep]; rollback to `KEEP`",
            "sqlite",
            (("SAVEPOINT", "keep"), ("ROLLBACK TO", "keep")),
        ),
        ("ROLLBACK", "postgresql", ()),
    ],
)
def test_savepoint_statements_are_read_with_their_names(
    sql: str, dialect: str, steps: tuple[tuple[str, str | None], ...]
) -> None:
    """As the server resolves names; two readings that disagree (a backslash in '...'
    with standard_conforming_strings unknown) read as a ROLLBACK TO no call opened."""
    from consumerdedup.db.control_sql import savepoint_steps

    assert savepoint_steps(sql, dialect) == steps


# What a handler leaves running -------------------------------------------------------------


def run_async(
    db: Database,
    handler: Any,
    batches: list[list[Message]],
    listen: Any = None,
    driver: str = "psycopg",
) -> Any:
    """``handler(dedup)`` made on a fresh one-connection async engine (psycopg or asyncpg);
    each batch in turn."""

    async def go() -> list[list[Result]]:
        engine = async_engine(db.url, driver, pool_size=1, max_overflow=0)
        if listen is not None:
            listen(engine.sync_engine)
        dedup = AsyncDeduplicator(engine, "round9", tables=db.tables, retry=FAST)
        handle = handler(dedup)
        try:
            return [await handle.process_batch(batch) for batch in batches]
        finally:
            await engine.dispose()

    return asyncio.run(go())


@pytest.mark.parametrize("driver", ASYNC_PG_DRIVERS)
@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
def test_a_rollback_inside_the_async_commit_is_not_reported_processed(
    pg_ledger: Database, claim_first: bool, driver: str
) -> None:
    """The raw connection rolled back by a callback after the check that the transaction is
    open, right before the pipeline's COMMIT (an engine commit listener): the COMMIT finds no
    transaction; before, the message was PROCESSED with neither effects nor record. (asyncpg:
    a ROLLBACK sent on its connection; the COMMIT's SAVEPOINT then finds none, 25P01.)"""
    from sqlalchemy import event
    from sqlalchemy.util import await_only

    insert = text(f"INSERT INTO {pg_ledger.name('ledger')} VALUES (:m)")
    armed: list[Any] = []

    def listen(sync_engine: Any) -> None:
        def at_commit(conn: Any) -> None:
            if armed and driver == "asyncpg":
                await_only(armed.pop().execute("ROLLBACK"))
            elif armed:
                await_only(armed.pop().rollback())

        event.listen(sync_engine, "commit", at_commit)

    def handler(dedup: AsyncDeduplicator) -> Any:
        @dedup.handler(claim_first=claim_first)
        async def handle(message: Message, session: Any) -> None:
            await session.execute(insert, {"m": message.id})
            if not message.id.endswith("again"):
                conn = await session.connection()
                armed.append(conn.sync_connection.connection.driver_connection)

        return handle

    (first,) = run_async(pg_ledger, handler, [msgs("m0")], listen, driver)
    assert_nothing_done_without_effects(pg_ledger, first)
    assert first[0].outcome is not Outcome.PROCESSED or recorded(pg_ledger) == {"m0": "processed"}
    assert first[0].outcome is not Outcome.DUPLICATE


def test_a_rollback_from_a_task_the_async_handler_started_is_refused(pg_ledger: Database) -> None:
    insert = text(f"INSERT INTO {pg_ledger.name('ledger')} VALUES (:m)")
    seen: list[str] = []
    tasks: list[asyncio.Task[None]] = []

    def handler(dedup: AsyncDeduplicator) -> Any:
        @dedup.handler
        async def handle(message: Message, session: Any) -> None:
            conn = await session.connection()
            raw = conn.sync_connection.connection.driver_connection

            async def roll_back() -> None:
                try:
                    await raw.rollback()
                    seen.append("rolled back")
                except Exception as error:
                    seen.append(type(error).__name__)

            tasks.append(asyncio.create_task(roll_back()))
            await asyncio.sleep(0)  # the task runs now, while the transaction is open
            await session.execute(insert, {"m": message.id})

        return handle

    (first,) = run_async(pg_ledger, handler, [msgs("m0")])
    assert seen == ["TransactionBroken"]
    assert outcomes(first) == [Outcome.PROCESSED], first[0].reason
    assert effects(pg_ledger) == ["m0"]
    assert recorded(pg_ledger) == {"m0": "processed"}


def test_a_cursor_an_async_handler_kept_is_refused_after_its_call(pg_ledger: Database) -> None:
    """A's task writes with a cursor made in A's call after A returned, while B's handler
    runs: refused (before, the write went into B's transaction and was lost with it)."""
    late: list[str] = []

    def handler(dedup: AsyncDeduplicator) -> Any:
        go, done = asyncio.Event(), asyncio.Event()

        @dedup.handler
        async def handle(message: Message, session: Any) -> None:
            conn = await session.connection()
            raw = conn.sync_connection.connection.driver_connection
            if message.id == "A":
                cursor = raw.cursor()

                async def write_later() -> None:
                    await go.wait()
                    try:
                        await cursor.execute(
                            f"INSERT INTO {pg_ledger.name('ledger')} VALUES ('A-late')"
                        )
                        late.append("ok")
                    except Exception as error:
                        late.append(type(error).__name__)
                    done.set()

                asyncio.get_running_loop().create_task(write_later())
            else:
                go.set()
                await asyncio.wait_for(done.wait(), 10)
                raise ValueError("B fails on its own")

        return handle

    first, then = run_async(pg_ledger, handler, [msgs("A"), msgs("B")])
    assert outcomes(first + then) == [Outcome.PROCESSED, Outcome.FAILED]
    assert late == ["TransactionBroken"]
    assert effects(pg_ledger) == []  # A's handler wrote nothing itself
    assert recorded(pg_ledger) == {"A": "processed", "B": "failed"}


# A handler's search_path ----------------------------------------------------------------------

from tests.attacks.test_round7_driver_guard import tenants  # noqa: E402, F401  (a fixture)


def _rows(engine: Engine, sql: str) -> list[Any]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(sql))]


def _async_tenant_run(
    engine: Engine, a: str, b: str, claim_first: bool, keyed: bool, driver: str = "psycopg"
) -> Any:
    """Twice m0 on an async engine (psycopg or asyncpg) whose path is tenant a's; the
    handler writes a's ledger, maybe adds a keyed event, then switches to tenant b's schema
    on the raw connection."""
    from consumerdedup import Outbox, Tables

    path: dict[str, Any] = (
        {"server_settings": {"search_path": a}}
        if driver == "asyncpg"
        else {"options": f"-csearch_path={a}"}
    )

    async def go() -> list[Outcome]:
        aengine = async_engine(engine.url, driver, pool_size=1, max_overflow=0, connect_args=path)
        tables = Tables.define()
        dedup = AsyncDeduplicator(aengine, "round9", tables=tables, retry=FAST)
        outbox = Outbox(tables)

        @dedup.handler(claim_first=claim_first)
        async def handle(message: Message, session: Any) -> None:
            await session.execute(text(f"INSERT INTO {a}.ledger VALUES (:m)"), {"m": message.id})
            if keyed:
                await outbox.add(session, "dest", b"{}", key=message.id)
            conn = await session.connection()
            raw = conn.sync_connection.connection.driver_connection
            await raw.execute(f"SET LOCAL search_path TO {b}")

        try:
            return [await handle(Message(id="m0", body=b"{}")) for _ in range(2)]
        finally:
            await aengine.dispose()

    return asyncio.run(go())


@pytest.mark.parametrize("driver", ASYNC_PG_DRIVERS)
@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
def test_async_records_stay_in_their_schema_whatever_the_search_path(
    tenants: tuple[Engine, str, str],  # noqa: F811
    claim_first: bool,
    driver: str,
) -> None:
    engine, a, b = tenants
    assert _async_tenant_run(engine, a, b, claim_first, keyed=False, driver=driver) == [
        Outcome.PROCESSED,
        Outcome.DUPLICATE,
    ]
    assert _rows(engine, f"SELECT message_id FROM {b}.processed_events") == []
    assert _rows(engine, f"SELECT message_id FROM {a}.processed_events") == [("m0",)]
    assert _rows(engine, f"SELECT mid FROM {a}.ledger") == [("m0",)]


@pytest.mark.parametrize("driver", ASYNC_PG_DRIVERS)
@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
def test_async_held_events_never_follow_a_path_changed_on_the_raw_connection(
    tenants: tuple[Engine, str, str],  # noqa: F811
    claim_first: bool,
    driver: str,
) -> None:
    """A keyed event held back, then the path changed below SQLAlchemy: fails closed (RETRY),
    never written to tenant b's outbox."""
    engine, a, b = tenants
    outcomes = _async_tenant_run(engine, a, b, claim_first, keyed=True, driver=driver)
    assert outcomes == [Outcome.RETRY] * 2
    assert _rows(engine, f"SELECT key FROM {b}.outbox") == []
    assert _rows(engine, f"SELECT message_id FROM {b}.processed_events") == []


def test_a_batch_mates_record_stays_in_the_transactions_schema(
    tenants: tuple[Engine, str, str],  # noqa: F811
) -> None:
    """Check-first, a batch: m0 switches the path, m1 writes where that leaves it (the
    handlers' business); both records go to the transaction's processed_events."""
    from consumerdedup import Tables

    engine, a, b = tenants
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {b}.ledger (mid TEXT)"))
    dedup = Deduplicator(engine, "round9", tables=Tables.define(), retry=FAST)

    @dedup.handler(claim_first=False)
    def handle(message: Message, session: Any) -> None:
        session.execute(text("INSERT INTO ledger VALUES (:m)"), {"m": message.id})
        if message.id == "m0":
            session.execute(text(f"SET LOCAL search_path TO {b}"))

    assert handle.batch(msgs("m0", "m1")) == [Outcome.PROCESSED, Outcome.PROCESSED]
    assert handle.batch(msgs("m0", "m1")) == [Outcome.DUPLICATE, Outcome.DUPLICATE]
    assert _rows(engine, f"SELECT count(*) FROM {a}.processed_events") == [(2,)]
    assert _rows(engine, f"SELECT count(*) FROM {b}.processed_events") == [(0,)]


@pytest.mark.parametrize("route", ["psycopg_transaction", "raw_sql"])
def test_an_async_keyed_outbox_event_undone_by_a_driver_savepoint_is_not_published(
    pg_ledger: Database, route: str
) -> None:
    from consumerdedup import Outbox

    outbox = Outbox(pg_ledger.tables)

    def handler(dedup: AsyncDeduplicator) -> Any:
        @dedup.handler
        async def handle(message: Message, session: Any) -> None:
            conn = await session.connection()
            raw = conn.sync_connection.connection.driver_connection
            await outbox.add(session, "dest", b"kept", key="k-kept")
            if route == "psycopg_transaction":
                try:
                    async with raw.transaction():
                        await outbox.add(session, "dest", b"undone", key="k-undone")
                        raise ValueError("undo the savepoint")
                except ValueError:
                    pass
            else:
                await raw.execute("SAVEPOINT undo")
                await outbox.add(session, "dest", b"undone", key="k-undone")
                await raw.execute("ROLLBACK TO SAVEPOINT undo")

        return handle

    ((result,),) = run_async(pg_ledger, handler, [msgs("m0")])
    keys = sorted(
        r[0] for r in _rows(pg_ledger.engine, f"SELECT key FROM {pg_ledger.name('outbox')}")
    )
    assert keys == (["k-kept"] if result.outcome is Outcome.PROCESSED else [])
    assert "k-undone" not in keys
