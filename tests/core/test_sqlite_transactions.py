"""SQLite transactions are real however the session is made and however the engine is set up.

The sqlite3 module sends BEGIN only before a write, so a transaction that
starts with a read or a SAVEPOINT is none, and a savepoint's RELEASE commits.
These tests hold the pipeline's guarantees on SQLite for a ``session_factory``
of the application's own (item 1 of issue 12), and for an engine that already
carries SQLAlchemy's documented recipe, whose BEGIN must not meet a second one
(item 2). The application's own ``engine.begin()`` keeps working throughout.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.orm import sessionmaker

from consumerdedup import (
    AsyncDeduplicator,
    Deduplicator,
    Message,
    OutboxRelay,
    Outcome,
    Pruner,
    RetryPolicy,
    SimulatedCrash,
    Tables,
    install,
)
from consumerdedup.testing import MemoryBroker

FAST = RetryPolicy(attempts=2, initial_delay=timedelta(0), max_delay=timedelta(0))


def with_recipe(engine: Engine) -> Engine:
    """SQLAlchemy's documented pysqlite fix, as an application would have set it up."""

    @event.listens_for(engine, "connect")
    def do_connect(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.isolation_level = None

    @event.listens_for(engine, "begin")
    def do_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN")

    return engine


class Store:
    """One SQLite file with our tables and a ledger; engines made on demand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.url = f"sqlite:///{path}"
        self.tables = Tables.define()
        engine = create_engine(self.url)
        with engine.connect() as conn:
            conn.exec_driver_sql("PRAGMA journal_mode=WAL")
        install(engine, self.tables)
        with engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE ledger (message_id TEXT, amount INTEGER)")
        engine.dispose()
        self.engines: list[Engine] = []

    def engine(self) -> Engine:
        engine = create_engine(self.url, connect_args={"timeout": 5})
        self.engines.append(engine)
        return engine

    def async_engine(self) -> AsyncEngine:
        engine = create_async_engine(f"sqlite+aiosqlite:///{self.path}")
        self.engines.append(engine.sync_engine)
        return engine

    def ledger(self) -> list[str]:
        with sqlite3.connect(self.path) as conn:
            return [row[0] for row in conn.execute("SELECT message_id FROM ledger")]

    def records(self) -> list[str]:
        with sqlite3.connect(self.path) as conn:
            return [row[0] for row in conn.execute("SELECT message_id FROM processed_events")]

    def write_locked(self) -> bool:
        """Whether another connection is refused the write lock right now."""
        other = sqlite3.connect(self.path, timeout=0, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as error:
            assert "locked" in str(error)
            return True
        finally:
            other.close()
        return False


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    made = Store(tmp_path / "app.db")
    yield made
    for engine in made.engines:
        engine.dispose()


def msg(mid: str, **data: Any) -> Message:
    return Message(id=mid, body=json.dumps({"amount": 1, **data}).encode())


INSERT = "INSERT INTO ledger (message_id, amount) VALUES (:m, 1)"

# --- item 1: session_factory ---------------------------------------------------------------


@pytest.mark.parametrize("claim_first", [True, False])
def test_session_factory_crash_mid_batch_after_a_savepoint_leaves_nothing(
    store: Store, claim_first: bool
) -> None:
    engine = store.engine()
    dedup = Deduplicator(
        engine, "ledger", tables=store.tables, session_factory=sessionmaker(engine), retry=FAST
    )

    @dedup.handler(claim_first=claim_first)
    def handle(message: Message, session: Any) -> None:
        if message.json().get("die"):
            raise SimulatedCrash("the process dies in the middle of the batch")
        with session.begin_nested():  # released: must still commit only with the batch
            session.execute(text(INSERT), {"m": message.id})

    with pytest.raises(SimulatedCrash):
        handle.batch([msg("m-1"), msg("m-2", die=True)])
    assert store.ledger() == []
    assert store.records() == []
    assert handle.batch([msg("m-1"), msg("m-2")]) == [Outcome.PROCESSED] * 2
    assert sorted(store.ledger()) == ["m-1", "m-2"]


@pytest.mark.parametrize("claim_first", [True, False])
def test_session_factory_transaction_holds_the_write_lock_from_its_first_statement(
    store: Store, claim_first: bool
) -> None:
    engine = store.engine()
    dedup = Deduplicator(
        engine, "ledger", tables=store.tables, session_factory=sessionmaker(engine)
    )
    seen: list[bool] = []

    @dedup.handler(claim_first=claim_first)
    def handle(message: Message, session: Any) -> None:
        seen.append(store.write_locked())  # check-first: only a SELECT has run so far

    assert handle(msg("m-1")) is Outcome.PROCESSED
    assert seen == [True]


@pytest.mark.parametrize("claim_first", [True, False])
async def test_async_session_factory_crash_mid_batch_after_a_savepoint_leaves_nothing(
    store: Store, claim_first: bool
) -> None:
    engine = store.async_engine()
    dedup = AsyncDeduplicator(
        engine,
        "ledger",
        tables=store.tables,
        session_factory=async_sessionmaker(engine),
        retry=FAST,
    )

    @dedup.handler(claim_first=claim_first)
    async def handle(message: Message, session: Any) -> None:
        if message.json().get("die"):
            raise SimulatedCrash("the process dies in the middle of the batch")
        async with session.begin_nested():
            await session.execute(text(INSERT), {"m": message.id})

    with pytest.raises(SimulatedCrash):
        await handle.batch([msg("m-1"), msg("m-2", die=True)])
    assert store.ledger() == []
    assert store.records() == []
    assert await handle.batch([msg("m-1"), msg("m-2")]) == [Outcome.PROCESSED] * 2
    assert sorted(store.ledger()) == ["m-1", "m-2"]
    await engine.dispose()


@pytest.mark.parametrize("claim_first", [True, False])
async def test_async_session_factory_transaction_holds_the_write_lock(
    store: Store, claim_first: bool
) -> None:
    engine = store.async_engine()
    dedup = AsyncDeduplicator(
        engine, "ledger", tables=store.tables, session_factory=async_sessionmaker(engine)
    )
    seen: list[bool] = []

    @dedup.handler(claim_first=claim_first)
    async def handle(message: Message, session: Any) -> None:
        seen.append(store.write_locked())

    assert await handle(msg("m-1")) is Outcome.PROCESSED
    assert seen == [True]
    await engine.dispose()


# --- item 2: an engine that already has the recipe -----------------------------------------


def applications_own_write(engine: Engine, value: str) -> None:
    with engine.begin() as conn:
        conn.execute(text(INSERT), {"m": value})


@pytest.mark.parametrize("factory", [False, True], ids=["default", "session_factory"])
def test_engine_with_the_recipe_processes_messages_and_keeps_its_begin(
    store: Store, factory: bool
) -> None:
    engine = with_recipe(store.engine())
    options: dict[str, Any] = {"session_factory": sessionmaker(engine)} if factory else {}
    dedup = Deduplicator(engine, "ledger", tables=store.tables, retry=FAST, **options)

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        with session.begin_nested():
            session.execute(text(INSERT), {"m": message.id})

    assert handle.batch([msg("m-1"), msg("m-2")]) == [Outcome.PROCESSED] * 2
    assert handle(msg("m-1")) is Outcome.DUPLICATE
    applications_own_write(engine, "app-1")
    assert sorted(store.ledger()) == ["app-1", "m-1", "m-2"]


def test_recipe_added_after_our_objects_exist_still_works(store: Store) -> None:
    engine = store.engine()
    dedup = Deduplicator(engine, "ledger", tables=store.tables, retry=FAST)
    relay = OutboxRelay(engine, MemoryBroker(), tables=store.tables)
    pruner = Pruner(engine, timedelta(days=7), tables=store.tables)
    with_recipe(engine)  # the application sets its engine up later

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        session.execute(text(INSERT), {"m": message.id})

    applications_own_write(engine, "app-1")
    assert handle(msg("m-1")) is Outcome.PROCESSED
    assert relay.drain() == 0
    assert pruner.prune() == 0
    applications_own_write(engine, "app-2")
    assert sorted(store.ledger()) == ["app-1", "app-2", "m-1"]


def test_a_plain_engine_is_left_as_the_application_made_it(store: Store) -> None:
    engine = store.engine()
    dedup = Deduplicator(engine, "ledger", tables=store.tables)
    OutboxRelay(engine, MemoryBroker(), tables=store.tables).drain()
    Pruner(engine, timedelta(days=7), tables=store.tables).prune()

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        session.execute(text(INSERT), {"m": message.id})

    assert handle(msg("m-1")) is Outcome.PROCESSED
    assert not event.contains(engine, "begin", lambda conn: None)
    assert not engine.dispatch.begin, "no begin hook of ours on the application's engine"
    with engine.connect() as conn:
        assert conn.connection.driver_connection.isolation_level == ""  # type: ignore[union-attr]


async def test_async_engine_with_the_recipe_processes_messages(store: Store) -> None:
    engine = store.async_engine()
    with_recipe(engine.sync_engine)
    dedup = AsyncDeduplicator(engine, "ledger", tables=store.tables, retry=FAST)

    @dedup.handler
    async def handle(message: Message, session: Any) -> None:
        async with session.begin_nested():
            await session.execute(text(INSERT), {"m": message.id})

    assert await handle.batch([msg("m-1"), msg("m-2")]) == [Outcome.PROCESSED] * 2
    async with engine.begin() as conn:
        await conn.execute(text(INSERT), {"m": "app-1"})
    assert sorted(store.ledger()) == ["app-1", "m-1", "m-2"]
    await engine.dispose()
