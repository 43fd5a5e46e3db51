"""asyncpg, supported by verification (issue 34): what the guard cannot read, it asks.

asyncpg says whether a transaction block is open, never whether it was aborted, so the
guard asks the server: after a handler call that met a database error (one statement),
and with every COMMIT (``SAVEPOINT ...; COMMIT`` in one round trip: refused in an aborted
transaction, 25P02, and outside one, 25P01). These attacks go where psycopg's suite
cannot: asyncpg's own connection (``driver_connection``, ``get_raw_connection()``), its
prepared statements, its savepoints, SQLAlchemy's adapter over it. The routes both drivers
share run in the shared tests (the asyncpg flavors, rounds 7 and 9). Real PostgreSQL,
through the public API; a pool of one connection, so every checkout gets the one a
handler used.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import asyncpg
import pytest
from sqlalchemy import event, text
from sqlalchemy.exc import DBAPIError

from consumerdedup import (
    AsyncDeduplicator,
    ConfigurationError,
    Message,
    Outcome,
    Result,
    RetryPolicy,
)
from tests.attacks.test_round6 import assert_nothing_done_without_effects, effects, recorded
from tests.conftest import Database
from tests.support.async_drivers import async_engine

FAST = RetryPolicy(attempts=2, initial_delay=timedelta(0), max_delay=timedelta(0))
Misbehave = Callable[[Any, Any], Awaitable[None]]


@pytest.fixture
def ledger(pg: Database) -> Database:
    with pg.engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {pg.name('ledger')} (mid TEXT)"))
    return pg


def msgs(*ids: str) -> list[Message]:
    return [Message(id=i, body=b"{}") for i in ids]


def outcomes(results: list[Result]) -> list[Outcome]:
    return [r.outcome for r in results]


async def raw_of(session: Any) -> Any:
    """asyncpg's own connection, as a handler reaches it through SQLAlchemy."""
    conn = await session.connection()
    fairy = await conn.get_raw_connection()
    return fairy.driver_connection


def run(
    db: Database,
    misbehave: Misbehave,
    batches: list[list[str]],
    claim_first: bool = True,
    culprit: str = "m1",
) -> list[list[Result]]:
    """Each batch through one AsyncDeduplicator on asyncpg; ``culprit``'s handler misbehaves
    after its write."""
    insert = text(f"INSERT INTO {db.name('ledger')} VALUES (:m)")

    async def go() -> list[list[Result]]:
        engine = async_engine(db.url, "asyncpg", pool_size=1, max_overflow=0)
        dedup = AsyncDeduplicator(engine, "apg", tables=db.tables, retry=FAST)

        @dedup.handler(claim_first=claim_first)
        async def handle(message: Message, session: Any) -> None:
            await session.execute(insert, {"m": message.id})
            if message.id == culprit:
                await misbehave(session, await raw_of(session))

        try:
            return [await handle.process_batch(msgs(*batch)) for batch in batches]
        finally:
            await engine.dispose()

    return asyncio.run(go())


def assert_culprit_alone(db: Database, first: list[Result], again: list[Result]) -> None:
    """m1 FAILED with its record and no effect; its batch-mates PROCESSED once each."""
    assert outcomes(first) == [
        Outcome.PROCESSED,
        Outcome.FAILED,
        Outcome.PROCESSED,
        Outcome.PROCESSED,
    ], [r.reason for r in first]
    assert outcomes(again) == [Outcome.DUPLICATE, Outcome.FAILED] + [Outcome.DUPLICATE] * 2
    assert effects(db) == ["m0", "m2", "m3"]
    assert recorded(db)["m1"] == Outcome.FAILED.value
    assert_nothing_done_without_effects(db, first + again)


BATCH = ["m0", "m1", "m2", "m3"]


# An error the guard never saw: the COMMIT's statement finds it ---------------------------------


@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
def test_an_error_below_the_guard_is_found_by_the_commits_statement(
    ledger: Database, claim_first: bool
) -> None:
    """A prepared statement's own fetch goes to asyncpg's protocol, past every watched method:
    its error is swallowed unseen. The transaction is aborted; asyncpg would send COMMIT, hear
    ROLLBACK and raise nothing (the reported bug): the SAVEPOINT sent with the COMMIT is
    refused (25P02), nothing is reported PROCESSED, and the span halves to the culprit."""

    async def misbehave(_session: Any, raw: Any) -> None:
        statement = await raw.prepare("SELECT 1 / $1::int")
        with contextlib.suppress(asyncpg.DivisionByZeroError):
            await statement.fetchval(0)

    first, again = run(ledger, misbehave, [BATCH, BATCH], claim_first)
    assert_culprit_alone(ledger, first, again)


def test_a_lone_message_whose_error_went_unseen_is_never_processed(ledger: Database) -> None:
    async def misbehave(_session: Any, raw: Any) -> None:
        statement = await raw.prepare("SELECT 1 / $1::int")
        with contextlib.suppress(asyncpg.DivisionByZeroError):
            await statement.fetchval(0)

    (first,) = run(ledger, misbehave, [["m1"]])
    assert outcomes(first) == [Outcome.FAILED], first[0].reason
    assert effects(ledger) == []
    assert_nothing_done_without_effects(ledger, first)


# Errors swallowed where the guard sees them: the server is asked at the call's end -----------


SWALLOWED: dict[str, Misbehave] = {}


def swallowed(name: str) -> Callable[[Misbehave], Misbehave]:
    def register(fn: Misbehave) -> Misbehave:
        SWALLOWED[name] = fn
        return fn

    return register


@swallowed("session")
async def _through_the_session(session: Any, _raw: Any) -> None:
    with contextlib.suppress(DBAPIError):
        await session.execute(text("SELECT 1 / 0"))


@swallowed("execute")
async def _through_execute(_session: Any, raw: Any) -> None:
    with contextlib.suppress(asyncpg.PostgresError):
        await raw.execute("SELECT 1 / 0")


@swallowed("fetchval")
async def _through_fetchval(_session: Any, raw: Any) -> None:
    with contextlib.suppress(asyncpg.PostgresError):
        await raw.fetchval("SELECT 1 / $1::int", 0)


@swallowed("executemany")
async def _through_executemany(_session: Any, raw: Any) -> None:
    with contextlib.suppress(asyncpg.PostgresError):
        await raw.executemany("SELECT 1 / $1::int", [(1,), (0,)])


@swallowed("copy_records_to_table")
async def _through_copy(_session: Any, raw: Any) -> None:
    with contextlib.suppress(asyncpg.PostgresError):
        await raw.copy_records_to_table("no_such_table_here", records=[(1,)])


@pytest.mark.parametrize("route", list(SWALLOWED))
def test_a_swallowed_error_fails_its_message_alone(ledger: Database, route: str) -> None:
    first, again = run(ledger, SWALLOWED[route], [BATCH, BATCH])
    assert_culprit_alone(ledger, first, again)
    assert "caught a database error" in (first[1].reason or ""), first[1].reason


@pytest.mark.parametrize("route", ["begin_nested", "asyncpg_transaction"])
def test_an_error_undone_by_a_savepoint_is_not_a_failure(ledger: Database, route: str) -> None:
    """The right way to let a statement fail: the server says the transaction is good (the
    probe), and the message is PROCESSED with its other writes."""

    async def misbehave(session: Any, raw: Any) -> None:
        if route == "begin_nested":
            with contextlib.suppress(DBAPIError):
                async with session.begin_nested():
                    await session.execute(text("SELECT 1 / 0"))
        else:
            with contextlib.suppress(asyncpg.PostgresError):
                async with raw.transaction():  # a savepoint inside SQLAlchemy's transaction
                    await raw.execute("SELECT 1 / 0")

    (first,) = run(ledger, misbehave, [BATCH])
    assert outcomes(first) == [Outcome.PROCESSED] * 4, [r.reason for r in first]
    assert effects(ledger) == BATCH
    assert_nothing_done_without_effects(ledger, first)


# Transaction control through asyncpg's own connection: refused before it is sent --------------


CONTROL: dict[str, Misbehave] = {}


def control(name: str) -> Callable[[Misbehave], Misbehave]:
    def register(fn: Misbehave) -> Misbehave:
        CONTROL[name] = fn
        return fn

    return register


@control("execute COMMIT")
async def _execute_commit(_session: Any, raw: Any) -> None:
    await raw.execute("COMMIT")


@control("execute query= COMMIT")
async def _execute_keyword(_session: Any, raw: Any) -> None:
    await raw.execute(query="COMMIT")


@control("executemany command= COMMIT")
async def _executemany_keyword(_session: Any, raw: Any) -> None:
    await raw.executemany(command="COMMIT", args=[()])


@control("execute hidden COMMIT")
async def _execute_hidden(_session: Any, raw: Any) -> None:
    await raw.execute("/* done */ SELECT 1; commit work")


@control("fetch ROLLBACK")
async def _fetch_rollback(_session: Any, raw: Any) -> None:
    await raw.fetch("ROLLBACK")


@control("prepare COMMIT")
async def _prepare_commit(_session: Any, raw: Any) -> None:
    statement = await raw.prepare("COMMIT")
    await statement.fetch()


@control("cursor END")
async def _cursor_end(_session: Any, raw: Any) -> None:
    async for _row in raw.cursor("END"):
        pass


@control("the adapter's transaction")
async def _the_adapters_transaction(session: Any, _raw: Any) -> None:
    """asyncpg's Transaction object SQLAlchemy's adapter holds: its commit() sends COMMIT on
    asyncpg's connection (refused there)."""
    conn = await session.connection()
    fairy = await conn.get_raw_connection()
    transaction = fairy.dbapi_connection._transaction
    await transaction.commit()


@control("adapter commit()")
async def _adapter_commit(session: Any, _raw: Any) -> None:
    await session.run_sync(lambda s: s.connection().connection.dbapi_connection.commit())


@pytest.mark.parametrize("swallow", [False, True], ids=["raised", "swallowed"])
@pytest.mark.parametrize("route", list(CONTROL))
@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
def test_transaction_control_on_asyncpgs_connection_fails_its_message_alone(
    ledger: Database, route: str, claim_first: bool, swallow: bool
) -> None:
    """Refused before it is sent; a handler that catches the refusal and goes on (its
    connection discarded) fails all the same."""

    async def misbehave(session: Any, raw: Any) -> None:
        try:
            await CONTROL[route](session, raw)
        except Exception:
            if not swallow:
                raise
            with contextlib.suppress(Exception):  # goes on writing: never committed
                await session.execute(text(f"INSERT INTO {ledger.name('ledger')} VALUES ('x')"))

    first, again = run(ledger, misbehave, [BATCH, BATCH], claim_first)
    assert_culprit_alone(ledger, first, again)


def test_a_rollback_from_a_task_the_handler_started_is_refused(ledger: Database) -> None:
    """SQLAlchemy's adapter's rollback() from another task while the call runs: refused, as
    psycopg's raw rollback() is (only the pipeline ends its transaction)."""
    seen: list[str] = []

    async def misbehave(session: Any, _raw: Any) -> None:
        conn = await session.connection()
        fairy = await conn.get_raw_connection()

        async def roll_back() -> None:
            from sqlalchemy.util import greenlet_spawn

            try:
                await greenlet_spawn(fairy.dbapi_connection.rollback)
                seen.append("rolled back")
            except Exception as error:
                seen.append(type(error).__name__)

        await asyncio.create_task(roll_back())

    (first,) = run(ledger, misbehave, [["m0", "m1", "m2"]])
    assert seen == ["TransactionBroken"]
    assert outcomes(first) == [Outcome.PROCESSED] * 3, [r.reason for r in first]
    assert effects(ledger) == ["m0", "m1", "m2"]


# Setup the guard cannot verify: refused ----------------------------------------------------


def test_an_adapter_set_to_autocommit_is_refused_before_any_statement(ledger: Database) -> None:
    """A connect listener that puts SQLAlchemy's asyncpg adapter in autocommit (no BEGIN is
    ever sent, each statement commits alone): ConfigurationError, nothing claimed."""

    async def go() -> None:
        engine = async_engine(ledger.url, "asyncpg", pool_size=1, max_overflow=0)

        @event.listens_for(engine.sync_engine, "connect")
        def autocommit(dbapi_connection: Any, _record: Any) -> None:
            dbapi_connection.autocommit = True

        dedup = AsyncDeduplicator(engine, "apg", tables=ledger.tables, retry=FAST)

        @dedup.handler
        async def handle(message: Message, session: Any) -> None:
            await session.execute(text(f"INSERT INTO {ledger.name('ledger')} VALUES ('x')"))

        try:
            with pytest.raises(ConfigurationError, match="AUTOCOMMIT"):
                await handle.process(msgs("m0")[0])
        finally:
            await engine.dispose()

    asyncio.run(go())
    assert recorded(ledger) == {}
    assert effects(ledger) == []


def test_an_autocommit_asyncpg_engine_is_refused_at_construction(ledger: Database) -> None:
    engine = async_engine(ledger.url, "asyncpg", isolation_level="AUTOCOMMIT")
    with pytest.raises(ConfigurationError, match="AUTOCOMMIT"):
        AsyncDeduplicator(engine, "apg", tables=ledger.tables)


# Bulk handlers ------------------------------------------------------------------------------


def test_a_bulk_handler_on_asyncpg_applies_each_message_once_and_isolates_a_swallower(
    ledger: Database,
) -> None:
    insert = text(f"INSERT INTO {ledger.name('ledger')} VALUES (:m)")
    ids = [f"b{i:03}" for i in range(200)]

    async def go() -> tuple[list[Result], list[Result]]:
        engine = async_engine(ledger.url, "asyncpg", pool_size=2, max_overflow=0)
        dedup = AsyncDeduplicator(engine, "apg-bulk", tables=ledger.tables, retry=FAST)

        @dedup.bulk_handler
        async def handle(batch: list[Message], session: Any) -> None:
            await session.execute(insert, [{"m": m.id} for m in batch])
            if any(m.id == "b100" for m in batch):
                raw = await raw_of(session)
                with contextlib.suppress(asyncpg.PostgresError):
                    await raw.execute("SELECT 1 / 0")

        try:
            return await handle.process_batch(msgs(*ids)), await handle.process_batch(msgs(*ids))
        finally:
            await engine.dispose()

    first, again = asyncio.run(go())
    expected = [Outcome.FAILED if i == "b100" else Outcome.PROCESSED for i in ids]
    assert outcomes(first) == expected
    assert outcomes(again) == [Outcome.FAILED if i == "b100" else Outcome.DUPLICATE for i in ids]
    assert effects(ledger) == sorted(set(ids) - {"b100"})
    assert_nothing_done_without_effects(ledger, first + again)


# A handler's search_path through the session -------------------------------------------------

from tests.attacks.test_round7_driver_guard import tenants  # noqa: E402, F401  (a fixture)


@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
def test_records_stay_in_the_transactions_schema_when_the_session_changes_the_path(
    tenants: tuple[Any, str, str],  # noqa: F811
    claim_first: bool,
) -> None:
    """Tenant a's path on the connection; the handler switches to tenant b's through the
    session (SQLAlchemy's route on asyncpg): the record goes to a's processed_events."""
    from consumerdedup import Tables

    engine, a, b = tenants

    async def go() -> list[Outcome]:
        aengine = async_engine(
            engine.url,
            "asyncpg",
            pool_size=1,
            max_overflow=0,
            connect_args={"server_settings": {"search_path": a}},
        )
        dedup = AsyncDeduplicator(aengine, "apg", tables=Tables.define(), retry=FAST)

        @dedup.handler(claim_first=claim_first)
        async def handle(message: Message, session: Any) -> None:
            await session.execute(text(f"INSERT INTO {a}.ledger VALUES (:m)"), {"m": message.id})
            await session.execute(text(f"SET LOCAL search_path TO {b}"))

        try:
            return [await handle(msgs("m0")[0]) for _ in range(2)]
        finally:
            await aengine.dispose()

    assert asyncio.run(go()) == [Outcome.PROCESSED, Outcome.DUPLICATE]
    with engine.connect() as conn:
        assert conn.execute(text(f"SELECT message_id FROM {a}.processed_events")).all() == [("m0",)]
        assert conn.execute(text(f"SELECT message_id FROM {b}.processed_events")).all() == []


# Twins --------------------------------------------------------------------------------------


@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
def test_concurrent_twins_on_asyncpg_apply_once(ledger: Database, claim_first: bool) -> None:
    """Two deliveries of one id at once, on two connections. Claim-first: the twin waits on
    the claim (seen waiting on a lock in pg_stat_activity while the first handler holds its
    transaction open) and never runs the handler. Check-first: both handlers run, the
    loser's record waits on the winner's key and rolls its work back. Either way: one
    PROCESSED, one DUPLICATE, the effect once."""
    import uuid

    app = f"apg-twins-{uuid.uuid4().hex[:10]}"
    insert = text(f"INSERT INTO {ledger.name('ledger')} VALUES (:m)")
    calls: list[str] = []
    waits: list[str] = []

    async def twin_waiting(conn: asyncpg.Connection) -> str:
        deadline = asyncio.get_running_loop().time() + 10
        sql = (
            "SELECT wait_event FROM pg_stat_activity "
            "WHERE application_name = $1 AND wait_event_type = 'Lock'"
        )
        while asyncio.get_running_loop().time() < deadline:
            waiting = await conn.fetchval(sql, app)
            if waiting:
                return str(waiting)
            await asyncio.sleep(0.01)
        raise AssertionError("the twin never waited on the first delivery's claim")

    async def go() -> list[Outcome]:
        engine = async_engine(
            ledger.url,
            "asyncpg",
            pool_size=2,
            max_overflow=0,
            connect_args={"server_settings": {"application_name": app}},
        )
        watcher = await asyncpg.connect(
            async_url_plain(ledger.url), server_settings={"application_name": "watcher"}
        )
        dedup = AsyncDeduplicator(engine, "apg-twins", tables=ledger.tables, retry=FAST)
        both_inside = asyncio.Barrier(2)

        @dedup.handler(claim_first=claim_first)
        async def handle(message: Message, session: Any) -> None:
            calls.append(message.id)
            await session.execute(insert, {"m": message.id})
            if claim_first:
                waits.append(await twin_waiting(watcher))
            else:
                await asyncio.wait_for(both_inside.wait(), 10)  # both past the lookup

        try:
            message = msgs("twin")[0]
            return list(await asyncio.gather(handle(message), handle(message)))
        finally:
            await watcher.close()
            await engine.dispose()

    outcomes = asyncio.run(go())
    assert sorted(outcomes, key=str) == sorted([Outcome.PROCESSED, Outcome.DUPLICATE], key=str)
    assert effects(ledger) == ["twin"]
    assert recorded(ledger) == {"twin": "processed"}
    if claim_first:
        assert calls == ["twin"] and waits
    else:
        assert calls == ["twin", "twin"]


def async_url_plain(url: str) -> str:
    """``url`` as asyncpg.connect takes it (``postgresql://``)."""
    from sqlalchemy.engine import make_url

    return make_url(url).set(drivername="postgresql").render_as_string(False)
