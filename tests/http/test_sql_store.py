"""The store contract (consumerdedup/http/store.py), one test per promise, on the SQL stores.

SqlStore and AsyncSqlStore, on SQLite, PostgreSQL and MariaDB, with a clock the test
moves (leases and expiry without waiting). The async store is driven
through the same test bodies by a small blocking view.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from consumerdedup.http import AsyncSqlStore, SqlStore, StoredResponse
from consumerdedup.http.sql_statements import is_lock_timeout
from consumerdedup.http.store import Claimed, Completed, InFlight, Mismatch
from tests.conftest import Database, database


@pytest.fixture(params=["sqlite", "postgresql", "mariadb"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    yield from database(request, request.param, tmp_path)


LEASE = timedelta(seconds=30)
DAY = timedelta(hours=24)
RESPONSE = StoredResponse(201, (("content-type", "application/octet-stream"),), b"\x00\xff" * 10)


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, delta: timedelta) -> None:
        self.now += delta


class Blocking:
    """AsyncSqlStore's methods called as if blocking (one event loop for the test)."""

    def __init__(self, store: AsyncSqlStore) -> None:
        self.store = store
        self.loop = asyncio.new_event_loop()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def call(*args: Any) -> Any:
            plain = [a.inner if isinstance(a, _BlockingSession) else a for a in args]
            return self.loop.run_until_complete(method(*plain))

        return call

    def session(self) -> Any:
        return _BlockingSession(AsyncSession(self.store.engine), self.loop)

    def close(self) -> None:
        self.loop.run_until_complete(self.store.engine.dispose())
        self.loop.close()


class _BlockingSession:
    def __init__(self, session: AsyncSession, loop: asyncio.AbstractEventLoop) -> None:
        self.inner = session
        self.loop = loop

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)
        return lambda *args: self.loop.run_until_complete(method(*args))


@pytest.fixture(params=["sync", "async"])
def store(request: pytest.FixtureRequest, db: Database) -> Iterator[Any]:
    clock = Clock()
    if request.param == "sync":
        sync = SqlStore(db.engine, db.tables, clock=clock)
        sync.session = lambda: Session(db.engine)  # type: ignore[attr-defined]
        sync.clock_ = clock  # type: ignore[attr-defined]
        yield sync
        return
    view = Blocking(AsyncSqlStore(db.async_engine(), db.tables, clock=clock))
    view.clock_ = clock  # type: ignore[attr-defined]
    try:
        yield view
    finally:
        view.close()


def claim(store: Any, key: str = "k", fingerprint: str = "f") -> Any:
    return store.claim("POST /p", key, fingerprint, LEASE)


def test_a_new_key_is_claimed_and_a_live_claim_answers_in_flight_or_mismatch(store: Any) -> None:
    assert isinstance(claim(store), Claimed)
    twin = claim(store)
    assert isinstance(twin, InFlight) and twin.retry_after == pytest.approx(30)
    assert claim(store, fingerprint="other") == Mismatch()
    assert isinstance(store.claim("POST /q", "k", "f", LEASE), Claimed)  # another scope


def test_a_claim_whose_lease_ran_out_is_taken_over_by_the_same_request_only(store: Any) -> None:
    first = claim(store)
    store.clock_.advance(LEASE)
    assert claim(store, fingerprint="other") == Mismatch()
    second = claim(store)
    assert isinstance(second, Claimed) and second.token != first.token
    # The first holder lost it: it can neither store, renew nor release.
    assert store.complete("POST /p", "k", first.token, RESPONSE, DAY) is False
    assert store.renew("POST /p", "k", first.token, LEASE) is False
    store.release("POST /p", "k", first.token)
    assert isinstance(claim(store), InFlight)
    assert store.complete("POST /p", "k", second.token, RESPONSE, DAY) is True


def test_renew_extends_the_lease(store: Any) -> None:
    held = claim(store)
    store.clock_.advance(timedelta(seconds=20))
    assert store.renew("POST /p", "k", held.token, LEASE) is True
    store.clock_.advance(timedelta(seconds=20))  # 40 s after the claim, 20 s after the renewal
    assert isinstance(claim(store), InFlight)


def test_a_completed_record_replays_verbatim_until_it_expires(store: Any) -> None:
    held = claim(store)
    assert store.complete("POST /p", "k", held.token, RESPONSE, DAY) is True
    assert claim(store) == Completed(RESPONSE)
    assert claim(store, fingerprint="other") == Mismatch()
    store.clock_.advance(DAY)
    assert isinstance(claim(store, fingerprint="other"), Claimed)  # a new request


def test_a_response_not_stored_is_remembered_as_such(store: Any) -> None:
    held = claim(store)
    assert store.complete("POST /p", "k", held.token, StoredResponse.unreplayable(200), DAY)
    answer = claim(store)
    assert isinstance(answer, Completed) and not answer.response.replayable
    assert answer.response.status == 200


def test_release_frees_the_key_and_only_for_its_holder(store: Any) -> None:
    held = claim(store)
    store.release("POST /p", "k", "not-the-token")
    assert isinstance(claim(store), InFlight)
    store.release("POST /p", "k", held.token)
    assert isinstance(claim(store), Claimed)


# Transactional: claim_in / complete_in in the caller's transaction.
def test_a_claim_in_a_transaction_commits_with_it_or_not_at_all(store: Any) -> None:
    session = store.session()
    assert isinstance(store.claim_in(session, "POST /t", "k", "f", timedelta(0)), Claimed)
    session.rollback()
    session.close()
    session = store.session()
    assert isinstance(store.claim_in(session, "POST /t", "k", "f", timedelta(0)), Claimed)
    store.complete_in(session, "POST /t", "k", RESPONSE, DAY)
    session.commit()
    session.close()
    session = store.session()
    assert store.claim_in(session, "POST /t", "k", "f", timedelta(0)) == Completed(RESPONSE)
    session.close()


def test_a_twin_waits_at_most_its_wait_then_is_in_flight_and_the_timeout_is_restored(
    store: Any, db: Database
) -> None:
    first = store.session()
    try:
        _twin_meets_the_lock(store, db, first)
    finally:  # a failed assertion must not leave the claim's lock to block the teardown
        first.rollback()
        first.close()


def _twin_meets_the_lock(store: Any, db: Database, first: Any) -> None:
    assert isinstance(store.claim_in(first, "POST /t", "k2", "f", timedelta(0)), Claimed)
    outcome: list[Any] = []

    def twin() -> None:  # its own thread: on SQLite the wait blocks in BEGIN IMMEDIATE
        own = Session(db.engine)
        plain = SqlStore(db.engine, db.tables, clock=store.clock_)
        try:
            outcome.append(plain.claim_in(own, "POST /t", "k2", "f", timedelta(milliseconds=50)))
        except Exception as error:
            outcome.append(error)
        finally:
            own.close()

    thread = threading.Thread(target=twin)
    thread.start()
    thread.join(30)
    assert len(outcome) == 1
    assert is_lock_timeout(outcome[0]) if isinstance(outcome[0], Exception) else True
    assert not isinstance(outcome[0], Claimed)
    # The endpoint's own statements run with the session's usual lock wait, not 50 ms.
    setting = {
        "postgresql": "SHOW lock_timeout",
        "mysql": "SELECT @@SESSION.innodb_lock_wait_timeout",
    }.get(db.dialect, "PRAGMA busy_timeout")
    before = store.session()
    usual = before.execute(text(setting)).scalar_one()
    before.close()
    assert first.execute(text(setting)).scalar_one() == usual


def test_postgresql_pipelined_claim_fails_closed_and_returns_its_connection_as_it_found_it(
    pg: Database,
) -> None:
    """PostgreSQL's transactional path (sql_pipeline.py) runs the request's connection in
    autocommit with our own BEGIN: a transaction ended behind the Session's back must not
    let a statement commit alone, nor the stored response's COMMIT commit anything, and the
    pool must get the connection back out of autocommit."""
    db = pg  # the pipelined path is PostgreSQL's (psycopg pipeline mode)
    from sqlalchemy import create_engine, func, select

    from consumerdedup.http.sql_store import ClaimLost
    from consumerdedup.http.transactional import CommitInEndpoint, hold_commits

    engine = create_engine(db.engine.url, pool_size=1, max_overflow=0)  # one connection
    store = SqlStore(engine, db.tables)
    table = db.tables.idempotency_keys
    try:
        session = Session(engine)
        try:
            assert isinstance(store.claim_in(session, "POST /t", "p1", "f", timedelta(0)), Claimed)
            raw = session.connection().connection.driver_connection
            assert raw.autocommit and raw.info.transaction_status == 2  # ours: INTRANS
            hold_commits(session)
            raw.rollback()  # the DB-API connection's own: the claim is gone
            with pytest.raises(CommitInEndpoint, match="ended the request's transaction"):
                session.execute(text("SELECT 1"))
        finally:
            session.close()
        session = Session(engine)
        try:
            claimed = store.claim_in(session, "POST /t", "p2", "f", timedelta(0))
            assert isinstance(claimed, Claimed)
            session.connection().connection.driver_connection.rollback()
            store.complete_in(session, "POST /t", "p2", RESPONSE, DAY, claimed.token)
            with pytest.raises(ClaimLost):
                session.commit()  # the UPDATE found no claim: its COMMIT never ran
        finally:
            session.close()
        with engine.connect() as conn:
            assert conn.connection.driver_connection.autocommit is False
            rows = conn.execute(select(func.count()).select_from(table)).scalar_one()
        assert rows == 0
    finally:
        engine.dispose()


@pytest.fixture(params=["postgresql", "mariadb"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """The servers where twins wait on each other's row lock (SQLite serializes writers)."""
    yield from database(request, request.param, tmp_path)


def waiting(db: Database) -> int:
    """How many sessions wait on a lock in a statement on this test's own tables."""
    mine = f"%{db.schema}%"
    if db.dialect == "postgresql":
        sql = (
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            f"AND query LIKE '{mine}'"
        )
    else:  # a claim's INSERT still running on this test's database is one blocked on a lock
        sql = (
            "SELECT count(*) FROM information_schema.processlist WHERE db = "
            f"'{db.schema}' AND info LIKE 'INSERT INTO {mine}' AND state = 'Update'"
        )
    return int(db.scalar(sql) or 0)


def test_twins_waiting_when_the_first_claim_rolls_back_run_once_and_never_deadlock(
    server: Database,
) -> None:
    """Six transactional twins wait on the first claim's row; it rolls back. Exactly one
    twin claims (and completes), the others wait on it and replay its response: no
    deadlock among the waiters (on MariaDB a plain INSERT's shared locks would upgrade into
    one), no twin refused with an error."""
    import time

    db = server
    store = SqlStore(db.engine, db.tables)
    first = Session(db.engine)
    outcomes: list[Any] = []
    lock = threading.Lock()

    def twin() -> None:
        own = Session(db.engine)
        try:
            got = store.claim_in(own, "POST /storm", "k", "f", timedelta(seconds=30))
            if isinstance(got, Claimed):
                store.complete_in(own, "POST /storm", "k", RESPONSE, DAY, got.token)
                own.commit()
            with lock:
                outcomes.append(got)
        except Exception as error:
            with lock:
                outcomes.append(error)
        finally:
            own.close()

    threads = [threading.Thread(target=twin) for _ in range(6)]
    try:
        assert isinstance(store.claim_in(first, "POST /storm", "k", "f", timedelta(0)), Claimed)
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 20
        while waiting(db) < 6:
            assert time.monotonic() < deadline, f"{waiting(db)} of 6 twins waiting"
            time.sleep(0.01)
    finally:
        first.rollback()
        first.close()
        for thread in threads:
            thread.join(60)
    assert not [o for o in outcomes if isinstance(o, Exception)], outcomes
    assert sum(isinstance(o, Claimed) for o in outcomes) == 1, outcomes
    assert outcomes.count(Completed(RESPONSE)) == 5, outcomes
