"""Round 13 attacks on ``consumerdedup.driver_connection(session)``, through the public API.

Every test ends on the business rows (a ledger without unique key: a double or a loss
shows) and the processed_events records: each message's effects exactly once with a
PROCESSED record, or none.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from consumerdedup import (
    AsyncDeduplicator,
    ConfigurationError,
    Deduplicator,
    Message,
    Outcome,
    RetryPolicy,
    driver_connection,
)
from tests.conftest import Database, database
from tests.core.test_mysql import Deadlocker

FAST_RETRY = RetryPolicy(attempts=6, initial_delay=timedelta(milliseconds=5))


def msgs(*ids: str) -> list[Message]:
    return [Message(id=i, body=b"x") for i in ids]


def either_handler(dedup: Any, shape: str, one: Any) -> Any:
    """``one(message, session)`` as a per-message handler ("handler"), or called for each
    message of a bulk handler's call ("bulk")."""
    if shape == "handler":
        return dedup.handler(one)

    @dedup.bulk_handler
    def handle(messages: list[Message], session: Any) -> None:
        for message in messages:
            one(message, session)

    return handle


def ledger_ids(db: Database, ledger: str) -> list[str]:
    with db.engine.connect() as conn:
        return sorted(r[0] for r in conn.execute(text(f"SELECT message_id FROM {ledger}")))


def records(db: Database) -> dict[str, str]:
    with db.engine.connect() as conn:
        rows = conn.execute(text(f"SELECT message_id, outcome FROM {db.name('processed_events')}"))
        return {r[0]: r[1] for r in rows}


def consistent(db: Database, ledger: str, results: list[Any]) -> None:
    """Each PROCESSED message has its row exactly once; every other none."""
    got = ledger_ids(db, ledger)
    recs = records(db)
    for result in results:
        mid = result.message.id if hasattr(result, "message") else None
        assert mid is not None
        if result.outcome is Outcome.PROCESSED:
            assert got.count(mid) == 1, (mid, got, recs)
            assert recs.get(mid) == "processed", (mid, recs)
        else:
            assert got.count(mid) == 0, (mid, got, recs, result.outcome)


def mark(db: Database) -> str:
    return "?" if db.dialect == "sqlite" else "%s"


def raw_insert(raw: Any, db: Database, ledger: str, mid: str) -> None:
    cursor = raw.cursor()
    try:
        cursor.execute(f"INSERT INTO {ledger} (message_id) VALUES ({mark(db)})", (mid,))
    finally:
        cursor.close()


KINDS = ["sqlite", "postgresql", "mariadb"]


@pytest.fixture(params=KINDS)
def anydb(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    yield from database(request, request.param, tmp_path)


# --- MariaDB: a deadlock swallowed through the raw PyMySQL cursor ------------------------


@pytest.mark.parametrize("kind", ["handler", "bulk"])
def test_mariadb_deadlock_swallowed_through_the_raw_cursor(mariadb: Database, kind: str) -> None:
    """m1 writes through the raw connection; m2 swallows a real deadlock (1213: the whole
    transaction, m1's claim and write with it, rolled back) met on the raw cursor, and
    writes again; m3 writes. Each message ends with its row once and PROCESSED, or none."""
    import pymysql

    ledger = mariadb.create_ledger()
    deadlocker = Deadlocker(mariadb)
    seen: list[int] = []
    dedup = Deduplicator(mariadb.engine, consumer="c", tables=mariadb.tables, retry=FAST_RETRY)

    def one(message: Message, session: Any) -> None:
        raw = driver_connection(session)
        raw_insert(raw, mariadb, ledger, message.id or "")
        if message.id == "m2" and not seen:
            cursor = raw.cursor()
            cursor.execute(deadlocker.first_half())
            deadlocker.start_other()
            try:
                cursor.execute(deadlocker.second_half())
            except pymysql.err.OperationalError as exc:
                seen.append(exc.args[0])
            with contextlib.suppress(Exception):  # swallowed
                raw_insert(raw, mariadb, ledger, "m2-after")

    handle = either_handler(dedup, kind, one)

    results = handle.process_batch(msgs("m1", "m2", "m3"))
    deadlocker.join()
    assert seen == [1213]
    assert "m2-after" not in ledger_ids(mariadb, ledger)
    consistent(mariadb, ledger, results)


# --- Transaction control sent through the raw connection, swallowed, mid-batch ------------

HOSTILE: dict[str, list[str]] = {
    "sqlite": [
        "commit()",
        "rollback()",
        "COMMIT",
        "ROLLBACK",
        "END",
        "BEGIN",
        "SAVEPOINT x",
        "RELEASE x",
        "or-rollback",
        "isolation_level=None",
        "executescript",
    ],
    "postgresql": [
        "commit()",
        "rollback()",
        "ROLLBACK; BEGIN",
        "COMMIT; BEGIN",
        "COMMIT AND CHAIN",
        "ROLLBACK AND CHAIN",
        "SAVEPOINT x; ROLLBACK TO SAVEPOINT x",
        "autocommit=True",
        "PREPARE TRANSACTION 'x'",
        "transaction()",
        "DO $$ BEGIN COMMIT; END $$",
        "CALL",
    ],
    "mysql": [
        "commit()",
        "rollback()",
        "begin()",
        "autocommit(True)",
        "COMMIT",
        "ROLLBACK",
        "BEGIN",
        "START TRANSACTION",
        "SET autocommit=1",
        "CREATE TABLE implicit_commit (i INT)",
        "LOCK TABLES {ledger} WRITE",
        "COMMIT AND CHAIN",
        "XA START 'x'",
        "ROLLBACK AND CHAIN",
    ],
}


def act(raw: Any, db: Database, ledger: str, what: str) -> None:
    if what.endswith("()") and what != "transaction()":
        getattr(raw, what[:-2])()
        return
    if what == "begin()":
        raw.begin()
        return
    if what == "autocommit(True)":
        raw.autocommit(True)
        return
    if what == "autocommit=True":
        raw.autocommit = True
        return
    if what == "isolation_level=None":
        raw.isolation_level = None
        return
    if what == "transaction()":
        with raw.transaction():
            raw_insert(raw, db, ledger, "m2-inner")
            raise RuntimeError("inner")
    if what == "or-rollback":
        cursor = raw.cursor()
        cursor.execute("CREATE TEMP TABLE IF NOT EXISTS u (k INTEGER UNIQUE)")
        cursor.execute("INSERT OR ROLLBACK INTO u VALUES (1)")
        cursor.execute("INSERT OR ROLLBACK INTO u VALUES (1)")
        return
    if what == "executescript":
        raw.executescript("SELECT 1;")
        return
    if what == "CALL":
        cursor = raw.cursor()
        schema = db.schema
        cursor.execute(f"CREATE PROCEDURE {schema}.p() LANGUAGE plpgsql AS $$ BEGIN COMMIT; END $$")
        cursor.execute(f"CALL {schema}.p()")
        return
    cursor = raw.cursor()
    try:
        cursor.execute(what.format(ledger=ledger))
    finally:
        cursor.close()


def _hostile_cases() -> list[Any]:
    out = []
    for dialect, whats in HOSTILE.items():
        kind = "mariadb" if dialect == "mysql" else dialect
        for w in whats:
            out.append(pytest.param(kind, w, id=f"{kind}-{w}"))
    return out


@pytest.mark.parametrize(("kind", "what"), _hostile_cases())
@pytest.mark.parametrize("shape", ["handler", "bulk"])
def test_transaction_control_through_the_raw_connection_swallowed(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str, what: str, shape: str
) -> None:
    for db in database(request, kind, tmp_path):
        _hostile_sync(db, what, shape)


def _hostile_sync(db: Database, what: str, shape: str) -> None:
    ledger = db.create_ledger()
    dedup = Deduplicator(db.engine, consumer="c", tables=db.tables, retry=FAST_RETRY)
    done: list[str] = []

    def one(message: Message, session: Any) -> None:
        raw = driver_connection(session)
        raw_insert(raw, db, ledger, message.id or "")
        if message.id == "m2" and not done:
            done.append("x")
            with contextlib.suppress(Exception):  # swallowed
                act(raw, db, ledger, what)
            with contextlib.suppress(Exception):  # swallowed
                raw_insert(raw, db, ledger, "m2-after")

    handle = either_handler(dedup, shape, one)

    results = handle.process_batch(msgs("m1", "m2", "m3"))
    got = ledger_ids(db, ledger)
    assert "m2-inner" not in got or what == "transaction()"
    consistent(db, ledger, results)
    # A redelivery changes nothing.
    again = handle.process_batch(msgs("m1", "m2", "m3"))
    assert all(r.outcome is not Outcome.PROCESSED for r in again) or got == []
    consistent(db, ledger, results)


# --- The same, on the asyncio drivers -----------------------------------------------------

ASYNC_HOSTILE: dict[str, list[str]] = {
    "sqlite": ["commit()", "rollback()", "ROLLBACK", "COMMIT", "or-rollback"],
    "postgresql": ["commit()", "rollback()", "ROLLBACK; BEGIN", "COMMIT; BEGIN"],
    "asyncpg": ["ROLLBACK; BEGIN", "COMMIT; BEGIN", "ROLLBACK AND CHAIN", "reset()"],
    "mariadb": [
        "commit()",
        "rollback()",
        "begin()",
        "autocommit(True)",
        "CREATE TABLE implicit_commit (i INT)",
        "SET autocommit=1",
    ],
}


async def async_insert(raw: Any, how: str, ledger: str, mid: str) -> None:
    if how == "asyncpg":
        await raw.execute(f"INSERT INTO {ledger} (message_id) VALUES ($1)", mid)
        return
    m = "?" if how == "sqlite" else "%s"
    cursor = raw.cursor() if hasattr(raw, "pgconn") else await raw.cursor()
    try:
        await cursor.execute(f"INSERT INTO {ledger} (message_id) VALUES ({m})", (mid,))
    finally:
        await cursor.close()


async def async_act(raw: Any, how: str, what: str) -> None:
    if what in ("commit()", "rollback()", "begin()", "reset()"):
        await getattr(raw, what[:-2])()
        return
    if what == "autocommit(True)":
        await raw.autocommit(True)
        return
    if how == "asyncpg":
        await raw.execute(what)
        return
    statements = [what]
    if what == "or-rollback":
        statements = [
            "CREATE TEMP TABLE IF NOT EXISTS u (k INTEGER UNIQUE)",
            "INSERT OR ROLLBACK INTO u VALUES (1)",
            "INSERT OR ROLLBACK INTO u VALUES (1)",
        ]
    cursor = raw.cursor() if hasattr(raw, "pgconn") else await raw.cursor()
    try:
        for statement in statements:
            await cursor.execute(statement)
    finally:
        await cursor.close()


def _async_cases() -> list[Any]:
    out = []
    for how, whats in ASYNC_HOSTILE.items():
        for w in whats:
            out.append(pytest.param(how, w, id=f"{how}-{w}"))
    return out


@pytest.mark.parametrize(("how", "what"), _async_cases())
@pytest.mark.parametrize("shape", ["handler", "bulk"])
def test_async_transaction_control_through_the_raw_connection_swallowed(
    request: pytest.FixtureRequest, tmp_path: Path, how: str, what: str, shape: str
) -> None:
    kind = "postgresql" if how == "asyncpg" else how
    for db in database(request, kind, tmp_path):
        _hostile_async(db, how, what, shape)


def _hostile_async(db: Database, how: str, what: str, shape: str) -> None:
    from tests.support.async_drivers import async_engine

    ledger = db.create_ledger()
    done: list[str] = []

    async def one(message: Message, session: Any) -> None:
        raw = driver_connection(session)
        await async_insert(raw, how, ledger, message.id or "")
        if message.id == "m2" and not done:
            done.append("x")
            with contextlib.suppress(Exception):  # swallowed
                await async_act(raw, how, what)
            with contextlib.suppress(Exception):  # swallowed
                await async_insert(raw, how, ledger, "m2-after")

    async def main() -> tuple[list[Any], list[Any]]:
        engine = async_engine(db.url, "asyncpg") if how == "asyncpg" else db.async_engine()
        dedup = AsyncDeduplicator(engine, consumer="c", tables=db.tables, retry=FAST_RETRY)
        if shape == "handler":
            handle: Any = dedup.handler(one)
        else:

            async def bulk(messages: list[Message], session: Any) -> None:
                for message in messages:
                    await one(message, session)

            handle = dedup.bulk_handler(bulk)
        try:
            first = await handle.process_batch(msgs("m1", "m2", "m3"))
            again = await handle.process_batch(msgs("m1", "m2", "m3"))
            return first, again
        finally:
            await engine.dispose()

    results, again = asyncio.run(main())
    consistent(db, ledger, results)
    consistent(db, ledger, [r for r in results if r.outcome is Outcome.PROCESSED])
    assert not any(r.outcome is Outcome.PROCESSED for r in again) or all(
        r.outcome is not Outcome.PROCESSED for r in results
    )


# --- Kept past its call ---------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["handler", "bulk"])
def test_a_session_kept_past_its_call_gives_no_driver_connection(
    anydb: Database, shape: str
) -> None:
    """The session kept after the call (and its batch) is over: ConfigurationError, not
    the driver's connection of a transaction that is no longer the message's."""
    ledger = anydb.create_ledger()
    dedup = Deduplicator(anydb.engine, consumer="c", tables=anydb.tables)
    kept: list[Any] = []

    def one(message: Message, session: Any) -> None:
        kept.append(session)
        raw_insert(driver_connection(session), anydb, ledger, message.id or "")

    if shape == "handler":
        handle: Any = dedup.handler(one)
    else:
        handle = dedup.bulk_handler(lambda messages, session: [one(m, session) for m in messages])
    results = handle.process_batch(msgs("k1", "k2"))
    assert [r.outcome for r in results] == [Outcome.PROCESSED] * 2
    for session in kept:
        with pytest.raises(ConfigurationError):
            driver_connection(session)
    consistent(anydb, ledger, results)


def test_a_thread_of_a_call_writing_through_the_raw_connection_after_it(pg: Database) -> None:
    """A thread a handler started writes through the driver's connection (a new cursor)
    after the call returned, while a batch-mate's call runs: the batch-mate then fails and
    the span is sent again. m1's effect must be in the ledger exactly once."""
    ledger = pg.create_ledger()
    engine = create_engine(pg.url, pool_size=1, max_overflow=0)
    dedup = Deduplicator(engine, consumer="c", tables=pg.tables, retry=FAST_RETRY)
    go = threading.Event()
    wrote = threading.Event()
    threads: list[threading.Thread] = []
    errors: list[BaseException] = []

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        raw = driver_connection(session)
        raw_insert(raw, pg, ledger, message.id or "")
        if message.id == "m1" and not threads:

            def late() -> None:
                go.wait(10)
                try:
                    raw_insert(raw, pg, ledger, "m1")
                except BaseException as exc:
                    errors.append(exc)
                wrote.set()

            threads.append(threading.Thread(target=late, daemon=True))
            threads[0].start()
        if message.id == "m2" and not go.is_set():
            go.set()
            assert wrote.wait(10)
            raise RuntimeError("m2 fails once: the span goes again")

    try:
        results = handle.process_batch(msgs("m1", "m2", "m3"))
    finally:
        go.set()
        for t in threads:
            t.join(10)
        engine.dispose()
    consistent(pg, ledger, results)
