"""Round 6: hostile handlers through the public API, on SQLite and the real PostgreSQL.

- A bulk handler that sends ``COMMIT`` as SQL through the raw driver connection
  (``session.connection().connection.driver_connection.execute("COMMIT")``, or a cursor of
  it), with half its writes before it: before, the COMMIT reached the server and committed
  the call's claims as PROCESSED, so every message was reported DUPLICATE at once, its
  effects never written (psycopg sync and async, aiosqlite; sqlite3's authorizer already
  denied it). Now refused before it is sent (raw_commit): FAILED, nothing recorded as done.
  The same from a per-message handler: before, claim-first answered a batch-mate DUPLICATE
  without its row, check-first applied two batch-mates twice (m0, m0, m1, m1, m2).
- A handler that never returns: nothing in the pipeline bounds it, its claim's row lock
  holds its twins; PostgreSQL's ``idle_in_transaction_session_timeout`` does (documented
  in docs/consumers.md), and the message is then applied once.
- A bulk handler that empties, shortens, reorders or extends its list: held (its own copy).
- A COMMIT through libpq itself (``pgconn.exec_``) or a cursor class made directly
  (``psycopg.Cursor(raw)``): not refused, it commits the call's claims as PROCESSED; before,
  the retry and the redelivery then answered DUPLICATE without the effects. Now the driver
  reports the ended transaction and the pipeline deletes the attempt's own claims before
  it goes on (handler_end, pipeline): nothing recorded as done without its effects (the
  attacks in every mode and driver: test_round6_commit_below).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import create_async_engine

from consumerdedup import AsyncDeduplicator, Deduplicator, Message, Outcome, Result, RetryPolicy
from tests.conftest import Database

FAST = RetryPolicy(attempts=2, initial_delay=timedelta(0), max_delay=timedelta(0))


@pytest.fixture
def ledger(db: Database) -> Database:
    with db.engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {db.name('ledger')} (mid TEXT)"))
    return db


def effects(db: Database) -> list[str]:
    with db.engine.connect() as conn:
        return sorted(r[0] for r in conn.execute(text(f"SELECT mid FROM {db.name('ledger')}")))


def recorded(db: Database) -> dict[str, str]:
    with db.engine.connect() as conn:
        sql = f"SELECT message_id, outcome FROM {db.name('processed_events')}"
        return {r[0]: r[1] for r in conn.execute(text(sql))}


def assert_nothing_done_without_effects(db: Database, results: list[Result]) -> None:
    """Invariant 1: PROCESSED or DUPLICATE only with the message's effects committed."""
    done = effects(db)
    for result in results:
        if result.outcome in (Outcome.PROCESSED, Outcome.DUPLICATE):
            assert result.message.id in done, f"{result.message.id} {result.outcome} w/o effects"
    for key, outcome in recorded(db).items():
        if outcome == Outcome.PROCESSED.value:
            assert key in done, f"{key} recorded PROCESSED without its effects"


def run_bulk(
    kind: str, db: Database, commit: Callable[[Any], Any], messages: list[Message]
) -> tuple[list[Result], list[Result]]:
    """A bulk handler writing half its rows, calling ``commit(raw)``, then the other half;
    the batch twice (the second time as a redelivery)."""
    insert = text(f"INSERT INTO {db.name('ledger')} VALUES (:m)")
    if kind == "sync":
        dedup = Deduplicator(db.engine, "round6", tables=db.tables, retry=FAST)

        @dedup.bulk_handler
        def place(batch: list[Message], session: Any) -> None:
            half = max(1, len(batch) // 2)
            session.execute(insert, [{"m": m.id} for m in batch[:half]])
            commit(session.connection().connection.driver_connection)
            if batch[half:]:
                session.execute(insert, [{"m": m.id} for m in batch[half:]])

        return place.process_batch(messages), place.process_batch(messages)

    async def go() -> tuple[list[Result], list[Result]]:
        engine = create_async_engine(db.async_url)
        dedup = AsyncDeduplicator(engine, "round6", tables=db.tables, retry=FAST)

        @dedup.bulk_handler
        async def place(batch: list[Message], session: Any) -> None:
            half = max(1, len(batch) // 2)
            await session.execute(insert, [{"m": m.id} for m in batch[:half]])
            raw = await (await session.connection()).get_raw_connection()
            await commit(raw.driver_connection)
            if batch[half:]:
                await session.execute(insert, [{"m": m.id} for m in batch[half:]])

        try:
            return await place.process_batch(messages), await place.process_batch(messages)
        finally:
            await engine.dispose()

    return asyncio.run(go())


def sql_commit(kind: str, route: str, swallow: bool) -> Callable[[Any], Any]:
    """COMMIT as SQL through the raw connection's execute() or a cursor of it."""

    def sync(raw: Any) -> None:
        try:
            (raw.execute if route == "execute" else raw.cursor().execute)("COMMIT")
        except Exception:
            if not swallow:
                raise

    async def asynchronous(raw: Any) -> None:
        try:
            if route == "execute":
                await raw.execute("COMMIT")
            else:
                cursor = raw.cursor()
                if asyncio.iscoroutine(cursor):  # aiosqlite's cursor() is awaited
                    cursor = await cursor
                await cursor.execute("COMMIT")
        except Exception:
            if not swallow:
                raise

    return sync if kind == "sync" else asynchronous


@pytest.mark.parametrize("swallow", [False, True], ids=["raised", "swallowed"])
@pytest.mark.parametrize("route", ["execute", "cursor"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_commit_sent_as_sql_through_the_raw_connection_records_nothing_as_done(
    ledger: Database, kind: str, route: str, swallow: bool
) -> None:
    messages = [Message(id=f"m{i}", body=b"{}") for i in range(4)]
    first, again = run_bulk(kind, ledger, sql_commit(kind, route, swallow), messages)
    assert_nothing_done_without_effects(ledger, first + again)
    assert [r.outcome for r in first] == [Outcome.FAILED] * 4, [r.reason for r in first]
    assert effects(ledger) == []
    assert set(recorded(ledger).values()) <= {Outcome.FAILED.value}


def test_a_handler_that_never_returns_is_bounded_only_by_the_database(
    pg: Database,
) -> None:
    """Nothing in the pipeline times a handler out: while it runs, its claim's row lock
    holds every twin of its key (another runner the broker gave the message to) at the
    claim. What bounds it is PostgreSQL's ``idle_in_transaction_session_timeout`` on the
    handler's engine: the server ends the stuck session, the twin's claim goes through
    and applies the message once; when the stuck handler returns at last, its COMMIT
    fails (transient) and its retry answers DUPLICATE. Effects: once."""
    with pg.engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {pg.name('ledger')} (mid TEXT)"))
    insert = text(f"INSERT INTO {pg.name('ledger')} VALUES (:m)")
    bounded = create_engine(
        pg.url, connect_args={"options": "-c idle_in_transaction_session_timeout=1000"}
    )
    release, entered = threading.Event(), threading.Event()
    stuck_dedup = Deduplicator(bounded, "round6", tables=pg.tables, retry=FAST)
    twin_dedup = Deduplicator(pg.engine, "round6", tables=pg.tables, retry=FAST)

    @stuck_dedup.handler
    def stuck(message: Message, session: Any) -> None:
        session.execute(insert, {"m": "stuck"})
        if not entered.is_set():
            entered.set()
            release.wait(60)  # never returns, as far as the twin can tell

    @twin_dedup.handler
    def twin(message: Message, session: Any) -> None:
        session.execute(insert, {"m": "twin"})

    message = Message(id="k-1", body=b"{}")
    outcomes: list[Outcome] = []
    worker = threading.Thread(target=lambda: outcomes.append(stuck(message)))
    worker.start()
    try:
        assert entered.wait(30)
        started = time.monotonic()
        assert twin(message) is Outcome.PROCESSED  # waits on the claim until the server acts
        waited = time.monotonic() - started
    finally:
        release.set()
        worker.join(60)
        bounded.dispose()
    assert 0.5 < waited < 30, f"the twin waited {waited:.1f} s"
    assert outcomes == [Outcome.DUPLICATE]
    assert effects(pg) == ["twin"]
    assert recorded(pg) == {"k-1": Outcome.PROCESSED.value}


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("mutate", ["clear", "pop", "reverse", "replace", "append"])
def test_a_bulk_handler_mutating_its_list_changes_nothing_of_the_outcomes(
    ledger: Database, kind: str, mutate: str
) -> None:
    """The list a bulk handler gets is its own: emptied, shortened, reordered, one replaced
    by a stranger or one added after the writes, the pipeline still decides the messages it
    handed over (each PROCESSED with its row), and a redelivery is DUPLICATE."""
    messages = [Message(id=f"m{i}", body=b"{}") for i in range(4)]

    def change(batch: list[Message]) -> None:
        stranger = Message(id="stranger", body=b"{}")
        {
            "clear": batch.clear,
            "pop": lambda: batch.pop(0),
            "reverse": batch.reverse,
            "replace": lambda: batch.__setitem__(0, stranger),
            "append": lambda: batch.append(stranger),
        }[mutate]()

    insert = text(f"INSERT INTO {ledger.name('ledger')} VALUES (:m)")
    if kind == "sync":
        dedup = Deduplicator(ledger.engine, "round6", tables=ledger.tables, retry=FAST)

        @dedup.bulk_handler
        def place(batch: list[Message], session: Any) -> None:
            session.execute(insert, [{"m": m.id} for m in batch])
            change(batch)

        first, again = place.process_batch(messages), place.process_batch(messages)
    else:

        async def go() -> tuple[list[Result], list[Result]]:
            engine = create_async_engine(ledger.async_url)
            dedup = AsyncDeduplicator(engine, "round6", tables=ledger.tables, retry=FAST)

            @dedup.bulk_handler
            async def place(batch: list[Message], session: Any) -> None:
                await session.execute(insert, [{"m": m.id} for m in batch])
                change(batch)

            try:
                return await place.process_batch(messages), await place.process_batch(messages)
            finally:
                await engine.dispose()

        first, again = asyncio.run(go())
    assert [(r.message.id, r.outcome) for r in first] == [
        (m.id, Outcome.PROCESSED) for m in messages
    ]
    assert [r.outcome for r in again] == [Outcome.DUPLICATE] * 4
    assert effects(ledger) == [m.id for m in messages]
    assert recorded(ledger) == {m.id: Outcome.PROCESSED.value for m in messages}


def _libpq_commit(raw: Any) -> None:
    raw.pgconn.exec_(b"COMMIT")


def _own_cursor_commit(raw: Any) -> None:
    psycopg.Cursor(raw).execute("COMMIT")  # a cursor made without the connection's factory


@pytest.mark.parametrize("commit", [_libpq_commit, _own_cursor_commit], ids=["libpq", "cursor"])
def test_a_commit_below_the_guarded_cursors_records_nothing_as_done(
    pg: Database, commit: Callable[[Any], None]
) -> None:
    with pg.engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {pg.name('ledger')} (mid TEXT)"))
    messages = [Message(id=f"m{i}", body=b"{}") for i in range(4)]
    first, again = run_bulk("sync", pg, commit, messages)
    assert_nothing_done_without_effects(pg, first + again)


@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
def test_a_commit_as_sql_from_a_message_handler_commits_nothing_of_its_batch(
    ledger: Database, claim_first: bool
) -> None:
    """The per-message twin of the bulk attack: the second handler of a batch of three sends
    COMMIT through the raw connection after its write. Before: claim-first, the claims of
    all three committed (the third answered DUPLICATE without its row); check-first, the
    first two's rows committed without their records (made again by the retry). Now it
    fails alone, its batch-mates processed once."""
    insert = text(f"INSERT INTO {ledger.name('ledger')} VALUES (:m)")
    dedup = Deduplicator(ledger.engine, "round6", tables=ledger.tables, retry=FAST)

    @dedup.handler(claim_first=claim_first)
    def place(message: Message, session: Any) -> None:
        session.execute(insert, {"m": message.id})
        if message.id == "m1":
            session.connection().connection.driver_connection.execute("COMMIT")

    messages = [Message(id=f"m{i}", body=b"{}") for i in range(3)]
    first, again = place.process_batch(messages), place.process_batch(messages)
    assert_nothing_done_without_effects(ledger, first + again)
    assert [r.outcome for r in first] == [Outcome.PROCESSED, Outcome.FAILED, Outcome.PROCESSED]
    assert effects(ledger) == ["m0", "m2"]
