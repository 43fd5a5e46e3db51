"""Round 6: the pipelined BEGIN on psycopg (db/pipelined_begin.py) through the public API.

A deduplicator's own sessions take their connection in autocommit and send BEGIN with
the first claim or lookup. Attacked with a pool of one connection (the application's
next checkout gets the very connection a message used):

- The application's ``begin`` listener on its engine (a ``SET LOCAL`` for row-level
  security, an audit INSERT): before, it ran while the connection was already in
  autocommit, before our BEGIN, so the SET LOCAL did nothing (the handler ran without
  the tenant) and the audit row committed alone, for an attempt that was rolled back.
- A connection whose own level the application set (a ``connect`` listener setting the
  driver's isolation_level, or ``SET SESSION CHARACTERISTICS``): before, our BEGIN named
  the dialect's default instead (the handler ran READ COMMITTED where the application's
  transactions run REPEATABLE READ or SERIALIZABLE), and SQLAlchemy's reset at checkin
  left the driver set to that default: the application's next transactions on that
  connection ran at another level than it configured.
- Held (no change needed): every handler misbehaviour listed in the brief (commit,
  rollback, close, raw commit/rollback, COMMIT/ROLLBACK/END/ABORT as SQL, a swallowed
  IntegrityError or statement_timeout, a deferred constraint at COMMIT, a killed backend
  before and after the claim, RetryLater, bulk bisection) gives the application back a
  transactional connection; create_engine/execution_options isolation levels, readonly,
  deferrable, creator=, pre_ping, NullPool, StaticPool; driver autocommit is refused and
  the connection stays in autocommit; SERIALIZABLE rejects a write skew.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.ext.asyncio import create_async_engine

from consumerdedup import AsyncDeduplicator, Deduplicator, Message, Outcome, RetryPolicy
from consumerdedup.errors import RetryLater
from tests.conftest import Database

FAST = RetryPolicy(attempts=2, initial_delay=timedelta(0), max_delay=timedelta(0))
ONE = {"pool_size": 1, "max_overflow": 0, "pool_timeout": 3}
KINDS = [("sync", True), ("sync", False), ("async", True), ("async", False)]
KIND_IDS = ["sync-claim", "sync-check", "async-claim", "async-check"]


def message() -> Message:
    return Message(id=uuid.uuid4().hex, body=b"{}", source="orders")


def count(pg: Database, table: str) -> int:
    value: Any = pg.scalar(f"SELECT count(*) FROM {table}")
    return int(value)


def app_table(pg: Database) -> str:
    name = pg.name("app_rows")
    with pg.engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {name} (v INTEGER)")
    return name


def app_checkout(engine: Engine, table: str) -> tuple[Any, Any, str]:
    """The application's own next transaction on ``engine``: the driver's autocommit and
    isolation_level, the level it runs at; a write it rolls back."""
    with engine.connect() as conn:
        raw: Any = conn.connection.driver_connection
        level = conn.exec_driver_sql("SHOW transaction_isolation").scalar()
        conn.exec_driver_sql(f"INSERT INTO {table} VALUES (1)")
        conn.rollback()
        return raw.autocommit, raw.isolation_level, str(level)


def sync_process(engine: Engine, pg: Database, claim_first: bool, fn: Callable[..., Any]) -> Any:
    dedup = Deduplicator(engine, "c", tables=pg.tables, retry=FAST)
    return dedup.handler(claim_first=claim_first)(fn).process(message())


# 1. The application's begin listener runs inside the transaction it begins ---------------


@pytest.mark.parametrize(("kind", "claim_first"), KINDS, ids=KIND_IDS)
def test_a_begin_listener_runs_in_the_messages_transaction(
    pg: Database, kind: str, claim_first: bool
) -> None:
    """Row-level security's ``SET LOCAL`` in a ``begin`` listener holds in the handler, and an
    audit row the listener writes is rolled back with a RETRY attempt, as without us."""
    audit = app_table(pg)
    make: Any = create_engine if kind == "sync" else create_async_engine
    engine = make(pg.url if kind == "sync" else pg.async_url, **ONE)
    sync_engine = engine if kind == "sync" else engine.sync_engine

    @event.listens_for(sync_engine, "begin")
    def tenant(conn: Any) -> None:
        conn.exec_driver_sql("SET LOCAL app.tenant = 't1'")
        conn.exec_driver_sql(f"INSERT INTO {audit} VALUES (1)")

    seen: list[Any] = []

    if kind == "sync":

        def handle(msg: Message, session: Any) -> None:
            seen.append(
                session.execute(text("SELECT current_setting('app.tenant', true)")).scalar()
            )
            raise RetryLater("not yet")

        result = sync_process(engine, pg, claim_first, handle)
        engine.dispose()
    else:

        async def go() -> Any:
            dedup = AsyncDeduplicator(engine, "c", tables=pg.tables, retry=FAST)

            @dedup.handler(claim_first=claim_first)
            async def handle(msg: Message, session: Any) -> None:
                query = text("SELECT current_setting('app.tenant', true)")
                seen.append((await session.execute(query)).scalar())
                raise RetryLater("not yet")

            try:
                return await handle.process(message())
            finally:
                await engine.dispose()

        result = asyncio.run(go())
    assert result.outcome is Outcome.RETRY
    assert seen and set(seen) == {"t1"}
    assert count(pg, audit) == 0
    assert count(pg, pg.tables.processed_events.fullname) == 0


# 2. The connection's own isolation level ----------------------------------------------------


def _driver_level(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def repeatable(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ


def _session_level(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def serializable(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.autocommit = True
        dbapi_connection.execute(
            "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL SERIALIZABLE"
        )
        dbapi_connection.autocommit = False


@pytest.mark.parametrize(
    ("configure", "level"),
    [(_driver_level, "repeatable read"), (_session_level, "serializable")],
    ids=["driver-isolation_level", "set-session-characteristics"],
)
@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
def test_the_connections_own_level_holds_in_the_handler_and_after(
    pg: Database, configure: Callable[[Engine], None], level: str, claim_first: bool
) -> None:
    table = app_table(pg)
    engine = create_engine(pg.url, **ONE)
    configure(engine)
    try:
        before = app_checkout(engine, table)
        assert before[0] is False and before[2] == level
        seen: list[Any] = []

        def handle(msg: Message, session: Any) -> None:
            seen.append(session.execute(text("SHOW transaction_isolation")).scalar())

        result = sync_process(engine, pg, claim_first, handle)
        assert result.outcome is Outcome.PROCESSED
        assert seen == [level]
        assert app_checkout(engine, table) == before  # the application's connection as it was
    finally:
        engine.dispose()
    assert count(pg, table) == 0


# 3. Held: whatever an attempt does, the application gets its connection back as it was -----


def _ledger(pg: Database) -> str:
    name = pg.name("ledger")
    with pg.engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {name} (message_id TEXT)")
        conn.exec_driver_sql(f"CREATE TABLE {pg.name('parent')} (id INTEGER PRIMARY KEY)")
        conn.exec_driver_sql(
            f"CREATE TABLE {pg.name('child')} (parent INTEGER REFERENCES {pg.name('parent')} "
            "DEFERRABLE INITIALLY DEFERRED)"
        )
    return name


def _raw(session: Any) -> Any:
    return session.connection().connection.driver_connection


def _swallowed(session: Any, sql: str) -> None:
    with contextlib.suppress(Exception):  # the handler's mistake under test: no savepoint
        session.execute(text(sql))


def _timed_out(pg: Database, session: Any) -> None:
    session.execute(text("SET LOCAL statement_timeout = 20"))
    _swallowed(session, "SELECT pg_sleep(2)")


def _killed(pg: Database, session: Any) -> None:
    pid = session.execute(text("SELECT pg_backend_pid()")).scalar()
    with pg.engine.connect() as conn:
        conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})


MISDEEDS: dict[str, tuple[Callable[[Database, Any], Any], Outcome]] = {
    "nothing": (lambda pg, s: None, Outcome.PROCESSED),
    "raises": (lambda pg, s: (_ for _ in ()).throw(ValueError("boom")), Outcome.FAILED),
    "retry-later": (lambda pg, s: (_ for _ in ()).throw(RetryLater("later")), Outcome.RETRY),
    "session.commit": (lambda pg, s: s.commit(), Outcome.FAILED),
    "session.rollback": (lambda pg, s: s.rollback(), Outcome.FAILED),
    "session.close": (lambda pg, s: s.close(), Outcome.FAILED),
    "connection.commit": (lambda pg, s: s.connection().commit(), Outcome.FAILED),
    "raw rollback": (lambda pg, s: _raw(s).rollback(), Outcome.FAILED),
    "raw commit": (lambda pg, s: _raw(s).commit(), Outcome.FAILED),
    "COMMIT": (lambda pg, s: s.execute(text("COMMIT")), Outcome.FAILED),
    "ROLLBACK": (lambda pg, s: s.execute(text("ROLLBACK")), Outcome.FAILED),
    "swallowed IntegrityError": (
        lambda pg, s: _swallowed(s, f"INSERT INTO {pg.name('parent')} VALUES (1), (1)"),
        Outcome.FAILED,
    ),
    "swallowed statement_timeout": (_timed_out, Outcome.FAILED),
    "deferred constraint": (
        lambda pg, s: s.execute(text(f"INSERT INTO {pg.name('child')} VALUES (7)")),
        Outcome.FAILED,
    ),
    "killed backend": (_killed, Outcome.RETRY),
}


@pytest.mark.parametrize("misdeed", list(MISDEEDS))
@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
def test_after_any_attempt_the_application_gets_a_transactional_connection(
    pg: Database, misdeed: str, claim_first: bool
) -> None:
    ledger, table = _ledger(pg), app_table(pg)
    engine = create_engine(pg.url, **ONE)
    act, expected = MISDEEDS[misdeed]

    def handle(msg: Message, session: Any) -> None:
        session.execute(text(f"INSERT INTO {ledger} VALUES (:m)"), {"m": msg.id})
        act(pg, session)

    try:
        result = sync_process(engine, pg, claim_first, handle)
        assert result.outcome is expected, result.error
        assert app_checkout(engine, table) == (False, None, "read committed")
    finally:
        engine.dispose()
    assert count(pg, table) == 0
    assert count(pg, ledger) == (1 if expected is Outcome.PROCESSED else 0)
    with pg.engine.connect() as conn:
        recorded = [r.outcome for r in conn.execute(pg.tables.processed_events.select())]
    assert recorded == {Outcome.PROCESSED: ["processed"], Outcome.FAILED: ["failed"]}.get(
        expected, []
    )


@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
def test_after_an_async_attempt_the_application_gets_a_transactional_connection(
    pg: Database, claim_first: bool
) -> None:
    ledger = _ledger(pg)
    engine = create_async_engine(pg.async_url, **ONE)

    async def go() -> list[tuple[Outcome, Any, Any]]:
        dedup = AsyncDeduplicator(engine, "c", tables=pg.tables, retry=FAST)
        seen = []

        async def raw_rollback(session: Any) -> None:
            raw = (await (await session.connection()).get_raw_connection()).driver_connection
            await raw.rollback()  # the handler really ends the transaction on the driver

        async def commit_sql(session: Any) -> None:
            await session.execute(text("COMMIT"))

        async def later(session: Any) -> None:
            raise RetryLater("later")

        async def swallowed(session: Any) -> None:
            with contextlib.suppress(Exception):
                await session.execute(text("SELECT 1/0"))

        for act in (raw_rollback, commit_sql, later, swallowed):

            @dedup.handler(claim_first=claim_first)
            async def handle(msg: Message, session: Any) -> None:
                await session.execute(text(f"INSERT INTO {ledger} VALUES (:m)"), {"m": msg.id})
                await act(session)  # noqa: B023 - called at once

            result = await handle.process(message())
            outcome = result.outcome
            if act is raw_rollback:  # the guard's verdict, not an error of the test's own
                assert "InvalidRequestError" not in str(result.reason), result.reason
                assert "TransactionBroken" in str(result.reason), result.reason
            async with engine.connect() as conn:
                raw: Any = conn.sync_connection.connection.driver_connection  # type: ignore[union-attr]
                seen.append((outcome, raw.autocommit, raw.isolation_level))
        await engine.dispose()
        return seen

    seen = asyncio.run(go())
    assert seen == [
        (Outcome.FAILED, False, None),
        (Outcome.FAILED, False, None),
        (Outcome.RETRY, False, None),
        (Outcome.FAILED, False, None),
    ]
    assert count(pg, ledger) == 0


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_driver_in_autocommit_is_refused_and_left_in_autocommit(pg: Database, kind: str) -> None:
    from consumerdedup import ConfigurationError

    make: Any = create_engine if kind == "sync" else create_async_engine
    engine = make(
        pg.url if kind == "sync" else pg.async_url, connect_args={"autocommit": True}, **ONE
    )

    async def async_go() -> Any:
        dedup = AsyncDeduplicator(engine, "c", tables=pg.tables, retry=FAST)

        async def handle(msg: Message, session: Any) -> None:
            raise AssertionError("never called")

        try:
            with pytest.raises(ConfigurationError, match="AUTOCOMMIT"):
                await dedup.handler(handle).process(message())
            async with engine.connect() as conn:
                raw: Any = conn.sync_connection.connection.driver_connection
                return raw.autocommit
        finally:
            await engine.dispose()

    if kind == "sync":
        try:
            with pytest.raises(ConfigurationError, match="AUTOCOMMIT"):
                sync_process(engine, pg, True, lambda msg, session: None)
            with engine.connect() as conn:
                autocommit = conn.connection.driver_connection.autocommit
        finally:
            engine.dispose()
    else:
        autocommit = asyncio.run(async_go())
    assert autocommit is True
    assert count(pg, pg.tables.processed_events.fullname) == 0


def test_bisecting_a_bulk_batch_gives_the_application_a_transactional_connection(
    pg: Database,
) -> None:
    ledger, table = _ledger(pg), app_table(pg)
    engine = create_engine(pg.url, **ONE)
    dedup = Deduplicator(engine, "c", tables=pg.tables, retry=FAST)

    @dedup.bulk_handler
    def handle(messages: list[Message], session: Any) -> None:
        for msg in messages:
            session.execute(text(f"INSERT INTO {ledger} VALUES (:m)"), {"m": msg.id})
        if any(msg.id.startswith("bad") for msg in messages):
            raise ValueError("a culprit in the call")

    batch = [Message(id=f"{'bad' if i == 3 else 'ok'}{i}", body=b"{}") for i in range(6)]
    try:
        outcomes = [r.outcome for r in handle.process_batch(batch)]
        assert app_checkout(engine, table) == (False, None, "read committed")
    finally:
        engine.dispose()
    assert outcomes == [Outcome.PROCESSED] * 3 + [Outcome.FAILED] + [Outcome.PROCESSED] * 2
    with pg.engine.connect() as conn:
        written = sorted(r[0] for r in conn.exec_driver_sql(f"SELECT * FROM {ledger}"))
    assert written == [
        "ok0",
        "ok1",
        "ok2",
        "ok4",
        "ok5",
    ]
    assert count(pg, table) == 0


# 4. Held: the engine's level is the handler's, and SERIALIZABLE is kept ---------------------


@pytest.mark.parametrize("how", ["create_engine", "execution_options"])
@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
def test_serializable_rejects_a_write_skew(pg: Database, how: str, claim_first: bool) -> None:
    """Two on-call doctors each go off call if the other is still on: SERIALIZABLE lets only
    one of them (the other's attempt fails to serialize, is retried and sees one left)."""
    doctors = pg.name("doctors")
    with pg.engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {doctors} (name TEXT, on_call BOOLEAN)")
        conn.exec_driver_sql(f"INSERT INTO {doctors} VALUES ('a', true), ('b', true)")
    if how == "create_engine":
        engine = create_engine(pg.url, isolation_level="SERIALIZABLE")
    else:
        engine = create_engine(pg.url).execution_options(isolation_level="SERIALIZABLE")
    retry = RetryPolicy(attempts=5, initial_delay=timedelta(0), max_delay=timedelta(0))
    dedup = Deduplicator(engine, "c", tables=pg.tables, retry=retry)
    both_read = threading.Barrier(2, timeout=10)
    levels: list[Any] = []

    @dedup.handler(claim_first=claim_first)
    def go_off_call(msg: Message, session: Any) -> None:
        levels.append(session.execute(text("SHOW transaction_isolation")).scalar())
        on_call = session.execute(text(f"SELECT count(*) FROM {doctors} WHERE on_call")).scalar()
        if len(levels) <= 2:  # the first attempts: both have read before either writes
            both_read.wait()
        if on_call >= 2:
            session.execute(
                text(f"UPDATE {doctors} SET on_call = false WHERE name = :n"), {"n": msg.id}
            )

    outcomes: dict[str, Outcome] = {}
    threads = [
        threading.Thread(
            target=lambda name=name: outcomes.update(
                {name: go_off_call.process(Message(id=name, body=b"{}")).outcome}
            )
        )
        for name in "ab"
    ]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        engine.dispose()
    assert outcomes == {"a": Outcome.PROCESSED, "b": Outcome.PROCESSED}
    assert set(levels) == {"serializable"} and len(levels) >= 3  # one attempt was retried
    assert count(pg, f"{doctors} WHERE on_call") == 1
