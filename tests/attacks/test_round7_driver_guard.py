"""Round 7: the handler guard watching psycopg's cursors (raw_commit, handler_guard).

On psycopg the guard no longer listens to SQLAlchemy's cursor events: while an attempt's
handlers run, every cursor the driver connection makes is a watching one and its
``commit()`` is replaced on the instance; the deduplicator's
own checkout runs with the driver in autocommit (pipelined BEGIN). Attacked through the
public API on the real PostgreSQL, with a pool of one connection (so the next checkout,
the pipeline's or the application's, gets the very connection a handler used).

Found and fixed in this round (now regression tests):

- A handler that gives its connection back (``session.close()``/``rollback()``) while its
  attempt runs: the connection could go to another checkout still carrying the call's
  guard (an innocent message FAILED unrecorded, a pooled connection refusing every later
  COMMIT), and the handler could go on writing on it. Now the pool's checkin discards it
  (invalidated): the handler's later statements fail, the next checkout gets a new one.
- A handler that sets ``raw.cursor_factory`` to another class: every cursor the connection
  makes for the call is now made watching, whatever the factory (its class swapped).
- A bytes query hiding a COMMIT under ``client_encoding`` SJIS: decoded in the
  connection's encoding, as the server reads it.
- The session handed to a handler used after the pipeline was done with it (a thread, a
  task): a deduplicator's own session begins no transaction once its attempt is over.
- A handler outlasting ``idle_in_transaction_session_timeout``: the connection dies and the
  error surfaces at another message's statement or at the COMMIT. It was taken for an
  outage (a lost connection), charged to the whole span, and the batch-mate before the
  culprit ended RETRY on every delivery. The server's timeouts on the transaction itself
  (25P03, 25P04) are now the message's own error (retry.py): the batch halves to it.

Closed in round 9 (issue 38 item 15; the xfail markers removed, twins in test_round9):

- A thread the handler started, writing through a cursor it made in the call after the
  handler returned: the cursor is refused once its call is over.
- A handler in a batch that sends ``ROLLBACK TO SAVEPOINT`` to a savepoint a batch-mate's
  handler left open: refused before it is sent (savepoints followed by name per call).
- A thread of the handler's rolling the raw connection back: refused while the guard is
  on; inside the pipeline's COMMIT, the COMMIT's answer (25P01) says nothing committed.
- A keyed ``Outbox.add`` and a savepoint on the raw connection (SAVEPOINT / ROLLBACK TO
  through it, ``raw.transaction()``): refused, as through SQLAlchemy.
- ``SET LOCAL search_path`` in a handler: the path is put back before our record, the
  held-back events and the next handler.

Still open (xfail strict, and in the README's unsupported handler behaviour):

- (Minor) An error swallowed at a server-side cursor's fetch, in a psycopg pipeline or
  at a COPY: FAILED as it should, but the reason does not name the error (the fetch, the
  pipeline's sync and the COPY block's end are not watched).

Held (regression tests): raw ``rollback()`` in a batch, a deferred constraint failing at
COMMIT, errors swallowed through stream_results / pipeline / COPY / statement_timeout,
transaction-control SQL through every watched route (SQLAlchemy text, exec_driver_sql,
raw execute, executemany, ClientCursor via the factory, named cursors, stream, pipeline),
``Connection.commit()``, raw ``commit()``, ``raw.transaction()``, PREPARE TRANSACTION, a
killed backend, a nested deduplicator, a bulk handler's misbehaving message, async
variants, an async handler cancelled mid-statement.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import create_async_engine

from consumerdedup import (
    AsyncDeduplicator,
    Deduplicator,
    Message,
    Outcome,
    Result,
    RetryPolicy,
    Tables,
    install,
)
from tests.attacks.test_round6 import assert_nothing_done_without_effects, effects, recorded
from tests.conftest import Database
from tests.support.async_drivers import ASYNC_PG_DRIVERS, async_engine

FAST = RetryPolicy(attempts=2, initial_delay=timedelta(0), max_delay=timedelta(0))


@pytest.fixture
def ledger(pg: Database) -> Database:
    with pg.engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {pg.name('ledger')} (mid TEXT)"))
    return pg


@pytest.fixture
def one(ledger: Database) -> Iterator[Engine]:
    """An engine with a pool of one connection: every checkout gets the same one."""
    engine = create_engine(ledger.url, pool_size=1, max_overflow=0, pool_timeout=30)
    yield engine
    engine.dispose()


def insert_sql(db: Database) -> Any:
    return text(f"INSERT INTO {db.name('ledger')} VALUES (:m)")


def raw_of(session: Any) -> Any:
    return session.connection().connection.driver_connection


def outcomes(results: list[Result]) -> list[Outcome]:
    return [r.outcome for r in results]


def msgs(*ids: str) -> list[Message]:
    return [Message(id=i, body=b"{}") for i in ids]


def app_commit_works(db: Database, engine: Engine) -> None:
    """The application's own transaction on the (only) pooled connection commits."""
    with engine.begin() as conn:
        conn.execute(insert_sql(db), {"m": "app"})
    assert "app" in effects(db)


def wait_for_the_other_call_to_end(raw: Any) -> None:
    """Until A's call has ended (its end takes the guard's mark off the raw connection, the
    mark B's call put there included), at most 5 s: what a slow handler B would see."""
    deadline = time.monotonic() + 5
    while vars(raw).get("_consumerdedup_watch") is not None and time.monotonic() < deadline:
        time.sleep(0.01)


# Breaks -------------------------------------------------------------------------------------


@pytest.mark.parametrize("end", ["close", "rollback"])
def test_a_raw_write_after_the_session_ended_never_commits(
    ledger: Database, one: Engine, end: str
) -> None:
    dedup = Deduplicator(one, "round7", tables=ledger.tables, retry=FAST)
    insert = insert_sql(ledger)
    refused: list[BaseException] = []

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        session.execute(insert, {"m": message.id})
        if message.id == "bad":
            raw = raw_of(session)
            session.close() if end == "close" else session.rollback()
            try:
                raw.execute(f"INSERT INTO {ledger.name('ledger')} VALUES ('bad-late')")
            except Exception as error:  # refused: what the guard should do
                refused.append(error)
                raise

    first = handle.process_batch(msgs("bad"))
    then = handle.process_batch(msgs("ok"))
    assert outcomes(first) == [Outcome.FAILED]
    assert outcomes(then) == [Outcome.PROCESSED]
    assert_nothing_done_without_effects(ledger, first + then)
    assert recorded(ledger)["bad"] == Outcome.FAILED.value
    assert effects(ledger) == ["ok"], "FAILED has its record and no effects"


@pytest.mark.parametrize("driver", ASYNC_PG_DRIVERS)
def test_a_raw_write_after_the_session_closed_never_commits_async(
    ledger: Database, driver: str
) -> None:
    insert = insert_sql(ledger)

    async def go() -> tuple[list[Result], list[Result]]:
        engine = async_engine(ledger.url, driver, pool_size=1, max_overflow=0)
        dedup = AsyncDeduplicator(engine, "round7", tables=ledger.tables, retry=FAST)

        @dedup.handler
        async def handle(message: Message, session: Any) -> None:
            await session.execute(insert, {"m": message.id})
            if message.id == "bad":
                conn = await session.connection()
                raw = conn.sync_connection.connection.driver_connection
                await session.close()
                await raw.execute(f"INSERT INTO {ledger.name('ledger')} VALUES ('bad-late')")

        try:
            return await handle.process_batch(msgs("bad")), await handle.process_batch(msgs("ok"))
        finally:
            await engine.dispose()

    first, then = asyncio.run(go())
    assert outcomes(first) == [Outcome.FAILED]
    assert outcomes(then) == [Outcome.PROCESSED]
    assert effects(ledger) == ["ok"], "FAILED has its record and no effects"


@pytest.mark.parametrize("end", ["rollback", "close"])
def test_a_handler_that_gives_its_connection_back_leaves_other_messages_alone(
    ledger: Database, one: Engine, end: str
) -> None:
    """A swallows an error the old way (``session.rollback()``) and goes on with other work
    while a second runner thread's message B takes the freed connection and runs its
    (innocent) handler. B must be PROCESSED with its row, the connection left sound."""
    dedup = Deduplicator(one, "round7", tables=ledger.tables, retry=FAST)
    insert = insert_sql(ledger)
    freed, b_running = threading.Event(), threading.Event()

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        session.execute(insert, {"m": message.id})
        if message.id == "A":
            session.rollback() if end == "rollback" else session.close()
            freed.set()
            b_running.wait(10)
        elif message.id == "B":
            b_running.set()
            wait_for_the_other_call_to_end(raw_of(session))

    got: dict[str, list[Result]] = {}
    worker = threading.Thread(target=lambda: got.update(A=handle.process_batch(msgs("A"))))
    worker.start()
    assert freed.wait(10)
    got["B"] = handle.process_batch(msgs("B"))
    worker.join(30)
    assert outcomes(got["A"]) == [Outcome.FAILED]
    assert outcomes(got["B"]) == [Outcome.PROCESSED], got["B"][0].reason
    assert outcomes(handle.process_batch(msgs("C"))) == [Outcome.PROCESSED]
    app_commit_works(ledger, one)
    assert effects(ledger) == ["B", "C", "app"]
    assert recorded(ledger) == {"A": "failed", "B": "processed", "C": "processed"}


def test_a_commit_as_sql_stays_refused_while_another_call_ends(
    ledger: Database, one: Engine
) -> None:
    dedup = Deduplicator(one, "round7", tables=ledger.tables, retry=FAST)
    insert = insert_sql(ledger)
    freed, b_running = threading.Event(), threading.Event()
    sent: list[str] = []

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        session.execute(insert, {"m": message.id})
        if message.id == "A":
            session.close()
            freed.set()
            b_running.wait(10)
        elif message.id == "B":
            b_running.set()
            wait_for_the_other_call_to_end(raw_of(session))
            session.execute(text("COMMIT"))
            sent.append("COMMIT went through")

    got: dict[str, list[Result]] = {}
    worker = threading.Thread(target=lambda: got.update(A=handle.process_batch(msgs("A"))))
    worker.start()
    assert freed.wait(10)
    got["B"] = handle.process_batch(msgs("B"))
    worker.join(30)
    assert not sent, "B's COMMIT as SQL must be refused before it is sent"
    assert outcomes(got["B"]) == [Outcome.FAILED]
    assert recorded(ledger).get("B") == Outcome.FAILED.value
    assert_nothing_done_without_effects(ledger, got["A"] + got["B"])


def test_a_handlers_thread_writing_after_it_returned_is_not_lost_silently(
    ledger: Database, one: Engine
) -> None:
    dedup = Deduplicator(one, "round7", tables=ledger.tables, retry=FAST)
    insert = insert_sql(ledger)
    go, done = threading.Event(), threading.Event()
    late: list[str] = []

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        session.execute(insert, {"m": message.id})
        if message.id == "A":
            cursor = raw_of(session).cursor()

            def write_later() -> None:
                go.wait(10)
                try:
                    cursor.execute(f"INSERT INTO {ledger.name('ledger')} VALUES ('A-late')")
                    late.append("ok")
                except Exception as error:
                    late.append(repr(error))
                done.set()

            threading.Thread(target=write_later, daemon=True).start()
        elif message.id == "B":
            go.set()
            done.wait(10)
            raise ValueError("B fails on its own")

    assert outcomes(handle.process_batch(msgs("A"))) == [Outcome.PROCESSED]
    assert outcomes(handle.process_batch(msgs("B"))) == [Outcome.FAILED]
    assert late, "the late write ran"
    # Either the late write was refused (the thread saw an error), or it committed.
    assert late != ["ok"] or "A-late" in effects(ledger), "the late write was lost silently"
    assert "B" not in effects(ledger)


@pytest.mark.parametrize("route", ["raw", "begin_nested"])
@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
def test_a_batch_mates_savepoint_is_not_reachable(
    ledger: Database, one: Engine, route: str, claim_first: bool
) -> None:
    dedup = Deduplicator(one, "round7", tables=ledger.tables, retry=FAST)
    insert = insert_sql(ledger)
    kept: dict[str, Any] = {}

    @dedup.handler(claim_first=claim_first)
    def handle(message: Message, session: Any) -> None:
        raw = raw_of(session)
        if message.id == "m0":  # leaves a savepoint open (a forgotten release)
            if route == "raw":
                raw.execute("SAVEPOINT keep")
            else:
                kept["sp"] = session.begin_nested()
        elif message.id == "m1":
            if route == "raw":
                raw.execute("ROLLBACK TO SAVEPOINT keep")
            else:
                kept["sp"].rollback()
        session.execute(insert, {"m": message.id})

    batch = msgs("m0", "m1", "m2")
    first = handle.process_batch(batch)
    again = handle.process_batch(batch)
    assert_nothing_done_without_effects(ledger, first + again)
    assert outcomes(first)[0] is Outcome.PROCESSED and outcomes(first)[2] is Outcome.PROCESSED


SWALLOWED_ROUTES = ["stream_results", "pipeline", "copy"]


def swallow(route: str, db: Database, session: Any) -> None:
    """A database error the handler catches and ignores, reached through ``route``."""
    raw = raw_of(session)
    try:
        if route == "stream_results":
            rows = session.execute(
                text("SELECT 1 / (x - 3) FROM generate_series(1, 5) x"),
                execution_options={"stream_results": True, "yield_per": 1},
            )
            for _ in rows:
                pass
        elif route == "pipeline":
            with raw.pipeline():
                raw.execute(f"INSERT INTO {db.name('ledger')} VALUES ('piped')")
                raw.execute("SELECT 1 / 0")
        elif route == "copy":
            with raw.cursor().copy(f"COPY {db.name('ledger')} FROM STDIN") as copy:
                copy.write("a\tb\tc\n")
        elif route == "statement_timeout":
            session.execute(text("SET LOCAL statement_timeout = '50ms'"))
            session.execute(text("SELECT pg_sleep(0.5)"))
    except (DBAPIError, psycopg.Error):
        pass


@pytest.mark.xfail(
    strict=True,
    reason="minor: an error swallowed at a server-side cursor's fetch, at a pipeline's sync "
    "or at the end of a COPY is not kept (not watched), so the FAILED reason does not say "
    "which error the handler swallowed",
)
@pytest.mark.parametrize("route", SWALLOWED_ROUTES)
def test_the_reason_names_the_error_swallowed(ledger: Database, one: Engine, route: str) -> None:
    dedup = Deduplicator(one, "round7", tables=ledger.tables, retry=FAST)

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        swallow(route, ledger, session)

    (result,) = handle.process_batch(msgs("bad"))
    assert result.outcome is Outcome.FAILED
    assert "went on (" in (result.reason or ""), result.reason


# Held ---------------------------------------------------------------------------------------


def run_batch(
    db: Database,
    engine: Engine,
    misbehave: Callable[[Any, Any], None],
    claim_first: bool = True,
) -> tuple[list[Result], list[Result]]:
    """m0..m3, m1's call misbehaving after its write; the batch twice (a redelivery)."""
    dedup = Deduplicator(engine, "round7", tables=db.tables, retry=FAST)
    insert = insert_sql(db)

    @dedup.handler(claim_first=claim_first)
    def handle(message: Message, session: Any) -> None:
        session.execute(insert, {"m": message.id})
        if message.id == "m1":
            misbehave(session, raw_of(session))

    batch = msgs("m0", "m1", "m2", "m3")
    return handle.process_batch(batch), handle.process_batch(batch)


def run_batch_async(
    db: Database, misbehave: Callable[[Any, Any], Awaitable[None]], driver: str = "psycopg"
) -> tuple[list[Result], list[Result]]:
    """``run_batch`` on the asyncio driver (psycopg or asyncpg): m1's call misbehaving after
    its write."""
    insert = insert_sql(db)

    async def go() -> tuple[list[Result], list[Result]]:
        engine = async_engine(db.url, driver, pool_size=1, max_overflow=0)
        dedup = AsyncDeduplicator(engine, "round7", tables=db.tables, retry=FAST)

        @dedup.handler
        async def handle(message: Message, session: Any) -> None:
            await session.execute(insert, {"m": message.id})
            if message.id == "m1":
                conn = await session.connection()
                await misbehave(session, conn.sync_connection.connection.driver_connection)

        batch = msgs("m0", "m1", "m2", "m3")
        try:
            return await handle.process_batch(batch), await handle.process_batch(batch)
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
    assert outcomes(again) == [
        Outcome.DUPLICATE,
        Outcome.FAILED,
        Outcome.DUPLICATE,
        Outcome.DUPLICATE,
    ]
    assert_nothing_done_without_effects(db, first + again)
    assert [e for e in effects(db) if e != "app"] == ["m0", "m2", "m3"]
    assert recorded(db)["m1"] == Outcome.FAILED.value


def _control_sql(how: str) -> Callable[[Any, Any], None]:
    def misbehave(session: Any, raw: Any) -> None:
        if how == "text":
            session.execute(text("/* x */ commit"))
        elif how == "exec_driver_sql":
            session.connection().exec_driver_sql("END")
        elif how == "raw_execute":
            raw.execute(b"COMMIT AND CHAIN")
        elif how == "executemany":
            raw.cursor().executemany("COMMIT", [(), ()])
        elif how == "named_cursor":
            raw.cursor(name="c1").execute("COMMIT")
        elif how == "stream":
            list(raw.cursor().stream("COMMIT"))
        elif how == "pipeline":
            with raw.pipeline():
                raw.execute("SELECT 1; COMMIT")
        elif how == "client_cursor_factory":
            raw.cursor_factory = psycopg.ClientCursor
            raw.cursor().execute("COMMIT")
        elif how == "connection_commit":
            session.connection().commit()
        elif how == "raw_commit":
            raw.commit()
        elif how == "raw_transaction_then_commit":
            with raw.transaction():
                raw.execute("SELECT 1")
            raw.commit()
        elif how == "prepare_transaction":
            raw.execute("PREPARE TRANSACTION 'round7'")

    return misbehave


CONTROL = [
    "text",
    "exec_driver_sql",
    "raw_execute",
    "executemany",
    "named_cursor",
    "stream",
    "pipeline",
    "connection_commit",
    "raw_commit",
    "raw_transaction_then_commit",
    "prepare_transaction",
]


@pytest.mark.parametrize("how", CONTROL)
@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
def test_transaction_control_through_a_watched_route_fails_its_message_alone(
    ledger: Database, one: Engine, how: str, claim_first: bool
) -> None:
    first, again = run_batch(ledger, one, _control_sql(how), claim_first)
    assert_culprit_alone(ledger, first, again)
    app_commit_works(ledger, one)


@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
def test_a_handler_cannot_put_an_unwatched_cursor_factory_back(
    ledger: Database, one: Engine, claim_first: bool
) -> None:
    def misbehave(session: Any, raw: Any) -> None:
        raw.cursor_factory = psycopg.ClientCursor
        session.execute(text("COMMIT"))

    first, again = run_batch(ledger, one, misbehave, claim_first)
    assert_culprit_alone(ledger, first, again)


def _broken(how: str) -> Callable[[Any, Any], None]:
    def misbehave(session: Any, raw: Any) -> None:
        if how == "raw_rollback":
            raw.rollback()
        elif how == "raw_rollback_then_write":
            raw.rollback()
            raw.execute("INSERT INTO pg_temp.nothing VALUES (1)")
        elif how == "terminate":
            with contextlib.suppress(DBAPIError):
                session.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))
        elif how == "deferred":
            uniq = ledger_of(session).name("round7_uniq")
            session.execute(text(f"INSERT INTO {uniq} VALUES ('x'), ('x')"))
        else:
            swallow(how, ledger_of(session), session)

    return misbehave


_current: dict[str, Database] = {}


def ledger_of(_session: Any) -> Database:
    return _current["db"]


BROKEN = ["raw_rollback", "raw_rollback_then_write", "deferred", *SWALLOWED_ROUTES]
BROKEN += ["statement_timeout", "terminate"]


@pytest.mark.parametrize("how", BROKEN)
@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
def test_a_broken_transaction_fails_its_message_alone(
    ledger: Database, one: Engine, how: str, claim_first: bool
) -> None:
    _current["db"] = ledger
    with one.begin() as conn:
        conn.execute(
            text(
                f"CREATE TABLE {ledger.name('round7_uniq')} (k TEXT, CONSTRAINT u UNIQUE (k) "
                "DEFERRABLE INITIALLY DEFERRED)"
            )
        )
    first, again = run_batch(ledger, one, _broken(how), claim_first)
    assert_culprit_alone(ledger, first, again)
    app_commit_works(ledger, one)


def test_a_nested_deduplicator_commits_on_its_own_and_once(ledger: Database) -> None:
    """The outer handler runs another deduplicator's handler (same engine, its own
    connection) and then fails: the inner message is PROCESSED once; redelivering the
    outer runs the inner as a DUPLICATE; nothing is doubled."""
    outer = Deduplicator(ledger.engine, "outer", tables=ledger.tables, retry=FAST)
    inner = Deduplicator(ledger.engine, "inner", tables=ledger.tables, retry=FAST)
    insert = insert_sql(ledger)
    seen: list[Outcome] = []

    @inner.handler
    def inner_handle(message: Message, session: Any) -> None:
        session.execute(insert, {"m": f"inner-{message.id}"})

    fail = {"m0"}

    @outer.handler
    def outer_handle(message: Message, session: Any) -> None:
        session.execute(insert, {"m": f"outer-{message.id}"})
        seen.append(inner_handle(message))
        if message.id in fail:
            raise ValueError("outer fails after the inner committed")

    assert outcomes(outer_handle.process_batch(msgs("m0"))) == [Outcome.FAILED]
    fail.clear()
    assert outcomes(outer_handle.process_batch(msgs("m1"))) == [Outcome.PROCESSED]
    assert seen == [Outcome.PROCESSED, Outcome.DUPLICATE, Outcome.PROCESSED]
    assert effects(ledger) == ["inner-m0", "inner-m1", "outer-m1"]


@pytest.mark.parametrize("how", ["raw_rollback", "text_commit", "swallowed"])
def test_a_bulk_call_with_one_misbehaving_message_isolates_it(
    ledger: Database, one: Engine, how: str
) -> None:
    dedup = Deduplicator(one, "round7", tables=ledger.tables, retry=FAST)
    insert = insert_sql(ledger)

    @dedup.bulk_handler
    def handle(batch: list[Message], session: Any) -> None:
        session.execute(insert, [{"m": m.id} for m in batch])  # insertmanyvalues
        if any(m.id == "m1" for m in batch):
            if how == "raw_rollback":
                raw_of(session).rollback()
            elif how == "text_commit":
                session.execute(text("COMMIT"))
            else:
                with contextlib.suppress(DBAPIError):
                    session.execute(text("SELECT 1 / 0"))

    batch = msgs("m0", "m1", "m2", "m3")
    first, again = handle.process_batch(batch), handle.process_batch(batch)
    assert_culprit_alone(ledger, first, again)
    app_commit_works(ledger, one)


@pytest.mark.parametrize("driver", ASYNC_PG_DRIVERS)
@pytest.mark.parametrize("how", ["text_commit", "raw_commit", "raw_rollback", "swallowed"])
def test_async_misbehaviour_fails_its_message_alone(
    ledger: Database, how: str, driver: str
) -> None:
    """On asyncpg the raw DB-API connection is SQLAlchemy's adapter over asyncpg's (its
    commit() and rollback(), run in SQLAlchemy's greenlet), and the error is swallowed from
    asyncpg's own connection: asyncpg cannot say the transaction is aborted, the server does."""

    def adapter(session: Any) -> Any:
        return session.connection().connection.dbapi_connection

    async def misbehave(session: Any, raw: Any) -> None:
        if how == "text_commit":
            await session.execute(text("COMMIT"))
        elif how == "raw_commit" and driver == "asyncpg":
            await session.run_sync(lambda s: adapter(s).commit())
        elif how == "raw_commit":
            await raw.commit()
        elif how == "raw_rollback" and driver == "asyncpg":
            await session.run_sync(lambda s: adapter(s).rollback())
        elif how == "raw_rollback":
            await raw.rollback()
        elif driver == "asyncpg":
            import asyncpg

            with contextlib.suppress(asyncpg.PostgresError):
                await raw.execute("SELECT 1 / 0")
        else:
            try:
                async with raw.pipeline():
                    await raw.execute("SELECT 1 / 0")
            except psycopg.Error:
                pass

    first, again = run_batch_async(ledger, misbehave, driver)
    assert_culprit_alone(ledger, first, again)


@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
def test_a_handler_killed_by_the_idle_timeout_fails_alone(
    ledger: Database, one: Engine, claim_first: bool
) -> None:
    """The server ends the connection (25P03) while m1's handler idles; the error surfaces
    at the next statement, another message's or our COMMIT. Charged like the message's own
    error, not as an outage: the batch halves to m1, its batch-mates commit, and m1 ends
    FAILED with the reason once its attempts are spent (it would outlast the bound on every
    delivery: retried for ever, it would hold its stream)."""

    def misbehave(session: Any, _raw: Any) -> None:
        session.execute(text("SET LOCAL idle_in_transaction_session_timeout = '100ms'"))
        time.sleep(0.4)

    first, again = run_batch(ledger, one, misbehave, claim_first)
    assert_culprit_alone(ledger, first, again)
    assert "idle-in-transaction timeout" in (first[1].reason or ""), first[1].reason


@pytest.mark.parametrize("driver", ASYNC_PG_DRIVERS)
def test_an_async_handler_killed_by_the_idle_timeout_fails_alone(
    ledger: Database, driver: str
) -> None:
    """The same on the asyncio drivers: the batch halves to the handler that idled."""

    async def misbehave(session: Any, _raw: Any) -> None:
        await session.execute(text("SET LOCAL idle_in_transaction_session_timeout = '100ms'"))
        await asyncio.sleep(0.4)

    first, again = run_batch_async(ledger, misbehave, driver)
    assert_culprit_alone(ledger, first, again)


def test_a_commit_hidden_by_the_client_encoding_is_refused(ledger: Database, one: Engine) -> None:
    def misbehave(_session: Any, raw: Any) -> None:
        raw.execute("SET LOCAL client_encoding TO 'SJIS'")
        raw.execute(b"SELECT E'\x95\\' ; COMMIT; SELECT 'x'")

    first, again = run_batch(ledger, one, misbehave)
    assert_culprit_alone(ledger, first, again)


@pytest.mark.parametrize("route", ["psycopg_transaction", "raw_sql"])
def test_a_keyed_outbox_event_undone_by_a_driver_savepoint_is_not_published(
    ledger: Database, one: Engine, route: str
) -> None:
    from consumerdedup import Outbox

    dedup = Deduplicator(one, "round7", tables=ledger.tables, retry=FAST)
    outbox = Outbox(ledger.tables)

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        raw = raw_of(session)
        outbox.add(session, "dest", b"kept", key="k-kept")
        if route == "psycopg_transaction":
            with contextlib.suppress(ValueError), raw.transaction():
                outbox.add(session, "dest", b"undone", key="k-undone")
                raise ValueError("undo the savepoint")
        else:
            raw.execute("SAVEPOINT undo")
            outbox.add(session, "dest", b"undone", key="k-undone")
            raw.execute("ROLLBACK TO SAVEPOINT undo")

    (result,) = handle.process_batch(msgs("m0"))
    with one.connect() as conn:
        keys = sorted(r[0] for r in conn.execute(text(f"SELECT key FROM {ledger.name('outbox')}")))
    # Either the handler is refused (as the same savepoint sent through SQLAlchemy is), or
    # the undone event is gone.
    if result.outcome is Outcome.PROCESSED:
        assert keys == ["k-kept"]
    else:
        assert keys == []


@pytest.mark.parametrize("driver", ASYNC_PG_DRIVERS)
def test_an_async_handler_cancelled_mid_statement_leaves_the_connection_sound(
    ledger: Database, driver: str
) -> None:
    """The application cancels a message's processing (``asyncio.wait_for``) while its
    handler waits on PostgreSQL: nothing of it commits, the guard is off the connection,
    and the next messages on that one pooled connection are processed."""
    insert = insert_sql(ledger)

    def still_guarded(raw: Any) -> list[str]:
        if driver == "asyncpg":  # asyncpg's class is swapped for a call, then put back
            import asyncpg

            return [] if type(raw) is asyncpg.Connection else [repr(type(raw))]
        return [k for k in vars(raw) if k in ("commit", "_consumerdedup_watch")]

    async def go() -> tuple[list[Result], list[str]]:
        engine = async_engine(ledger.url, driver, pool_size=1, max_overflow=0)
        dedup = AsyncDeduplicator(engine, "round7", tables=ledger.tables, retry=FAST)

        @dedup.handler
        async def handle(message: Message, session: Any) -> None:
            await session.execute(insert, {"m": message.id})
            if message.id == "slow":
                await session.execute(text("SELECT pg_sleep(2)"))

        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(handle.process_batch(msgs("slow")), 0.3)
            results = await handle.process_batch(msgs("ok0", "ok1"))
            async with engine.connect() as conn:
                left = still_guarded((await conn.get_raw_connection()).driver_connection)
            return results, left
        finally:
            await engine.dispose()

    results, left = asyncio.run(go())
    assert outcomes(results) == [Outcome.PROCESSED, Outcome.PROCESSED]
    assert left == []
    assert effects(ledger) == ["ok0", "ok1"]
    assert "slow" not in recorded(ledger)


@pytest.fixture
def tenants(postgres_url: str) -> Iterator[tuple[Engine, str, str]]:
    """Two tenants, schema per tenant, each with the library's tables under their default
    (unqualified) names; the engine's connections have tenant a's search_path."""
    import uuid

    a, b = (f"t7{x}_{uuid.uuid4().hex[:8]}" for x in "ab")
    admin = create_engine(postgres_url)
    with admin.begin() as conn:
        for schema in (a, b):
            conn.execute(text(f"CREATE SCHEMA {schema}"))
    engines = [
        create_engine(
            postgres_url,
            pool_size=1,
            max_overflow=0,
            connect_args={"options": f"-csearch_path={schema}"},
        )
        for schema in (a, b)
    ]
    try:
        for engine in engines:
            install(engine, Tables.define())
        with admin.begin() as conn:
            conn.execute(text(f"CREATE TABLE {a}.ledger (mid TEXT)"))
        yield engines[0], a, b
    finally:
        for engine in engines:
            engine.dispose()
        with admin.begin() as conn:
            for schema in (a, b):
                conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
        admin.dispose()


def _rows(engine: Engine, sql: str) -> list[Any]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(sql))]


def _tenant_handler(
    engine: Engine, a: str, b: str, route: str, claim_first: bool, keyed_event: bool
) -> Any:
    from consumerdedup import Outbox

    tables = Tables.define()
    dedup = Deduplicator(engine, "round7", tables=tables, retry=FAST)
    outbox = Outbox(tables)

    @dedup.handler(claim_first=claim_first)
    def handle(message: Message, session: Any) -> None:
        session.execute(text(f"INSERT INTO {a}.ledger VALUES (:m)"), {"m": message.id})
        if keyed_event:
            outbox.add(session, "dest", b"{}", key=message.id)
        switch = f"SET LOCAL search_path TO {b}"  # the handler works in another schema
        if route == "sqlalchemy":
            session.execute(text(switch))
        else:
            raw_of(session).execute(switch)

    return handle


@pytest.mark.parametrize("route", ["sqlalchemy", "raw"])
def test_claim_first_records_in_the_claims_schema_whatever_the_search_path(
    tenants: tuple[Engine, str, str], route: str
) -> None:
    engine, a, b = tenants
    handle = _tenant_handler(engine, a, b, route, claim_first=True, keyed_event=False)
    assert handle(Message(id="m0", body=b"{}")) is Outcome.PROCESSED
    assert handle(Message(id="m0", body=b"{}")) is Outcome.DUPLICATE
    assert _rows(engine, f"SELECT message_id, outcome FROM {a}.processed_events") == [
        ("m0", "processed")
    ]
    assert _rows(engine, f"SELECT message_id FROM {b}.processed_events") == []
    assert _rows(engine, f"SELECT mid FROM {a}.ledger") == [("m0",)]


@pytest.mark.parametrize("route", ["sqlalchemy", "raw"])
def test_check_first_records_in_the_lookups_schema_whatever_the_search_path(
    tenants: tuple[Engine, str, str], route: str
) -> None:
    engine, a, b = tenants
    handle = _tenant_handler(engine, a, b, route, claim_first=False, keyed_event=False)
    first = handle(Message(id="m0", body=b"{}"))
    again = handle(Message(id="m0", body=b"{}"))
    assert _rows(engine, f"SELECT message_id FROM {b}.processed_events") == []
    assert (first, again) == (Outcome.PROCESSED, Outcome.DUPLICATE)
    assert _rows(engine, f"SELECT mid FROM {a}.ledger") == [("m0",)]


@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
def test_held_back_outbox_events_stay_in_their_schema(
    tenants: tuple[Engine, str, str], claim_first: bool
) -> None:
    engine, a, b = tenants
    handle = _tenant_handler(engine, a, b, "raw", claim_first=claim_first, keyed_event=True)
    # The path changed through the raw connection while the event was held: as through
    # SQLAlchemy, the message goes again alone, and again (it always does so): RETRY.
    assert handle(Message(id="m0", body=b"{}")) is Outcome.RETRY
    assert _rows(engine, f"SELECT key FROM {b}.outbox") == []
    assert _rows(engine, f"SELECT key FROM {a}.outbox") == []
    assert _rows(engine, f"SELECT message_id FROM {b}.processed_events") == []


@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
def test_a_rollback_from_the_handlers_thread_before_commit_is_not_reported_processed(
    ledger: Database, one: Engine, claim_first: bool
) -> None:
    from sqlalchemy import event

    dedup = Deduplicator(one, "round7", tables=ledger.tables, retry=FAST)
    insert = insert_sql(ledger)
    go, done = threading.Event(), threading.Event()
    armed: list[bool] = []

    def at_commit(_conn: Any) -> None:
        # The application's own listener, used here only to time the thread's rollback:
        # it lands between the handler's return and the pipeline's COMMIT.
        if armed:
            armed.clear()
            go.set()
            done.wait(5)

    event.listen(one, "commit", at_commit)

    @dedup.handler(claim_first=claim_first)
    def handle(message: Message, session: Any) -> None:
        session.execute(insert, {"m": message.id})
        raw = raw_of(session)

        def roll_back_later() -> None:
            go.wait(5)
            raw.rollback()
            done.set()

        threading.Thread(target=roll_back_later, daemon=True).start()
        armed.append(True)

    results = handle.process_batch(msgs("m0"))
    assert go.is_set()
    assert_nothing_done_without_effects(ledger, results)
    if results[0].outcome is Outcome.PROCESSED:
        assert recorded(ledger) == {"m0": "processed"}


def test_the_handlers_session_is_dead_once_the_pipeline_is_done_with_it(
    ledger: Database, one: Engine
) -> None:
    dedup = Deduplicator(one, "round7", tables=ledger.tables, retry=FAST)
    insert = insert_sql(ledger)
    threads: list[threading.Thread] = []
    late: list[str] = []

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        session.execute(insert, {"m": message.id})

        def write_later() -> None:
            time.sleep(0.3)  # the pipeline has rolled back and recorded FAILED by now
            try:
                session.execute(insert, {"m": f"{message.id}-late"})
                session.commit()
                late.append("committed")
            except Exception as error:
                late.append(repr(error))

        thread = threading.Thread(target=write_later, daemon=True)
        threads.append(thread)
        thread.start()
        raise ValueError("the message fails")

    assert outcomes(handle.process_batch(msgs("m0"))) == [Outcome.FAILED]
    for thread in threads:
        thread.join(5)
    assert late
    assert recorded(ledger) == {"m0": "failed"}
    assert effects(ledger) == [], "FAILED has its record and no effects"


@pytest.mark.parametrize("end", ["rollback", "close"])
def test_a_nested_deduplicator_after_the_outer_session_ended_still_commits(
    ledger: Database, one: Engine, end: str
) -> None:
    outer = Deduplicator(one, "outer", tables=ledger.tables, retry=FAST)
    inner = Deduplicator(one, "inner", tables=ledger.tables, retry=FAST)
    insert = insert_sql(ledger)
    seen: list[Result] = []

    @inner.handler
    def inner_handle(message: Message, session: Any) -> None:
        session.execute(insert, {"m": f"inner-{message.id}"})

    @outer.handler
    def outer_handle(message: Message, session: Any) -> None:
        session.execute(insert, {"m": f"outer-{message.id}"})
        session.rollback() if end == "rollback" else session.close()
        seen.append(inner_handle.process(message))

    (result,) = outer_handle.process_batch(msgs("m0"))
    assert result.outcome is Outcome.FAILED
    assert "commit()" not in (result.reason or ""), result.reason
    assert seen[0].outcome is Outcome.PROCESSED, seen[0].reason
    assert effects(ledger) == ["inner-m0"]


def test_the_handlers_async_session_is_dead_once_the_pipeline_is_done(ledger: Database) -> None:
    insert = insert_sql(ledger)

    async def go() -> list[Result]:
        engine = create_async_engine(ledger.async_url, pool_size=1, max_overflow=0)
        dedup = AsyncDeduplicator(engine, "round7", tables=ledger.tables, retry=FAST)
        tasks: list[asyncio.Task[None]] = []

        @dedup.handler
        async def handle(message: Message, session: Any) -> None:
            await session.execute(insert, {"m": message.id})

            async def write_later() -> None:
                await asyncio.sleep(0.3)
                with contextlib.suppress(Exception):
                    await session.execute(insert, {"m": f"{message.id}-late"})
                    await session.commit()

            tasks.append(asyncio.create_task(write_later()))
            raise ValueError("the message fails")

        try:
            results = await handle.process_batch(msgs("m0"))
            await asyncio.gather(*tasks)
            return results
        finally:
            await engine.dispose()

    assert outcomes(asyncio.run(go())) == [Outcome.FAILED]
    assert recorded(ledger) == {"m0": "failed"}
    assert effects(ledger) == [], "FAILED has its record and no effects"
