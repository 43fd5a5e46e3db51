"""``consumerdedup.driver_connection(session)``: the driver's own connection of a handler's
transaction, on every database and driver the deduplicators take.

What it must hold: a write sent through it commits with the message's record, or is rolled
back with it (the handler raises after it, or a batch-mate's failure sends the span again);
it is the connection SQLAlchemy's own route reaches; the guard holds on it as through the
session (a COMMIT sent through it is refused, and nothing of the call commits); outside a
handler call there is no such transaction to give: ConfigurationError.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from consumerdedup import (
    AsyncDeduplicator,
    ConfigurationError,
    Deduplicator,
    Message,
    Outcome,
    PermanentError,
    driver_connection,
)
from tests.conftest import Database, database
from tests.support.async_drivers import async_engine

KINDS = [
    ("sqlite", "sync"),
    ("sqlite", "async"),
    ("postgresql", "sync"),
    ("postgresql", "async"),
    ("postgresql", "asyncpg"),
    ("mariadb", "sync"),
    ("mariadb", "async"),
]


@pytest.fixture(params=KINDS, ids=["-".join(k) for k in KINDS])
def kind(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Database, str]]:
    dialect, how = request.param
    for db in database(request, dialect, tmp_path):
        yield db, how


def _insert(db: Database, how: str, ledger: str) -> str:
    """The INSERT of a ledger row in the driver's own parameter style."""
    mark = {"sqlite": "?", "asyncpg": "$1"}.get(db.dialect if how != "asyncpg" else how, "%s")
    return f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('d', 1, {mark})"


def _send_sync(raw: Any, sql: str, value: str) -> None:
    cursor = raw.cursor()
    try:
        cursor.execute(sql, (value,))
    finally:
        cursor.close()


async def _send_async(raw: Any, how: str, sql: str, value: str) -> None:
    if how == "asyncpg":
        await raw.execute(sql, value)
        return
    cursor = await raw.cursor() if not hasattr(raw, "pgconn") else raw.cursor()
    try:
        await cursor.execute(sql, (value,))
    finally:
        await cursor.close()


def _run(db: Database, how: str, body: Any, messages: list[Message]) -> list[Any]:
    """``body(raw, session, message)`` as a per-message handler's, through process_batch."""
    if how == "sync":
        dedup = Deduplicator(db.engine, consumer="driver", tables=db.tables)

        @dedup.handler
        def handle(message: Message, session: Any) -> None:
            body(driver_connection(session), session, message)

        return handle.process_batch(messages)

    async def main() -> list[Any]:
        engine = async_engine(db.url, "asyncpg") if how == "asyncpg" else db.async_engine()
        dedup = AsyncDeduplicator(engine, consumer="driver", tables=db.tables)

        @dedup.handler
        async def handle(message: Message, session: Any) -> None:
            await body(driver_connection(session), session, message)

        try:
            return await handle.process_batch(messages)
        finally:
            await engine.dispose()

    return asyncio.run(main())


def _rows(db: Database, ledger: str) -> list[str]:
    with db.engine.connect() as conn:
        return sorted(r[0] for r in conn.execute(text(f"SELECT message_id FROM {ledger}")))


def _records(db: Database) -> dict[str, str]:
    with db.engine.connect() as conn:
        rows = conn.execute(text(f"SELECT message_id, outcome FROM {db.name('processed_events')}"))
        return {r[0]: r[1] for r in rows}


def _handler(db: Database, how: str, ledger: str, fail: str | None = None) -> Any:
    """Writes the message's row through the driver's connection; raises for ``fail``
    after writing it."""
    sql = _insert(db, how, ledger)
    if how == "sync":

        def body(raw: Any, session: Any, message: Message) -> None:
            _send_sync(raw, sql, message.id or "")
            if message.id == fail:
                raise PermanentError("after its write")

        return body

    async def body_async(raw: Any, session: Any, message: Message) -> None:
        await _send_async(raw, how, sql, message.id or "")
        if message.id == fail:
            raise PermanentError("after its write")

    return body_async


def test_a_write_through_it_commits_with_the_record_or_not_at_all(
    kind: tuple[Database, str],
) -> None:
    db, how = kind
    ledger = db.create_ledger()
    messages = [Message(id=f"m{i}", body=b"{}") for i in range(5)]
    results = _run(db, how, _handler(db, how, ledger, fail="m2"), messages)
    assert [r.outcome for r in results] == [
        Outcome.PROCESSED,
        Outcome.PROCESSED,
        Outcome.FAILED,
        Outcome.PROCESSED,
        Outcome.PROCESSED,
    ]
    # m2's write went with its failure; its batch-mates' went once each, though the span
    # they were first written in was rolled back when m2 failed and sent again.
    assert _rows(db, ledger) == ["m0", "m1", "m3", "m4"]
    assert _records(db) == {
        "m0": "processed",
        "m1": "processed",
        "m2": "failed",
        "m3": "processed",
        "m4": "processed",
    }
    # A redelivery is answered from the records: nothing is written again.
    again = _run(db, how, _handler(db, how, ledger), messages)
    assert {r.outcome for r in again} <= {Outcome.DUPLICATE, Outcome.FAILED}
    assert _rows(db, ledger) == ["m0", "m1", "m3", "m4"]


def test_it_is_the_connection_sqlalchemy_reaches(kind: tuple[Database, str]) -> None:
    db, how = kind
    seen: list[bool] = []

    def body(raw: Any, session: Any, message: Message) -> None:
        seen.append(raw is session.connection().connection.driver_connection)

    async def body_async(raw: Any, session: Any, message: Message) -> None:
        route = await (await session.connection()).get_raw_connection()
        seen.append(raw is route.driver_connection)

    chosen = body if how == "sync" else body_async
    results = _run(db, how, chosen, [Message(id="a", body=b"{}"), Message(id="b", body=b"{}")])
    assert [r.outcome for r in results] == [Outcome.PROCESSED, Outcome.PROCESSED]
    assert seen == [True, True]


def test_a_commit_through_it_is_refused_and_nothing_of_the_call_commits(
    kind: tuple[Database, str],
) -> None:
    db, how = kind
    ledger = db.create_ledger()
    sql = _insert(db, how, ledger)

    def body(raw: Any, session: Any, message: Message) -> None:
        _send_sync(raw, sql, message.id or "")
        raw.commit()

    async def body_async(raw: Any, session: Any, message: Message) -> None:
        await _send_async(raw, how, sql, message.id or "")
        if how == "asyncpg":
            await raw.execute("COMMIT")
        else:
            await raw.commit()

    chosen = body if how == "sync" else body_async
    results = _run(db, how, chosen, [Message(id="c", body=b"{}")])
    assert results[0].outcome is not Outcome.PROCESSED
    assert _rows(db, ledger) == []
    assert _records(db).get("c") in (None, "failed")


PG_KINDS = [k for k in KINDS if k[0] == "postgresql"]


@pytest.fixture(params=PG_KINDS, ids=["-".join(k) for k in PG_KINDS])
def pg_kind(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Database, str]]:
    for db in database(request, "postgresql", tmp_path):
        yield db, request.param[1]


def test_a_write_through_it_that_fails_only_at_commit_fails_its_message_alone(
    pg_kind: tuple[Database, str],
) -> None:
    """A deferred constraint that one message's write through the driver's connection
    breaks is reported by the COMMIT, which names no message: the span is halved until the
    culprit stands alone. It ends FAILED without its row; its batch-mates' rows are
    written once each, though the spans they were first written in were rolled back."""
    db, how = pg_kind
    ledger = db.name("deferred_ledger")
    with db.engine.begin() as conn:
        conn.execute(
            text(
                f"CREATE TABLE {ledger} (message_id TEXT, account TEXT, CONSTRAINT "
                f"{db.name('one_account').split('.')[-1]} UNIQUE (account) "
                "DEFERRABLE INITIALLY DEFERRED)"
            )
        )
        conn.execute(text(f"INSERT INTO {ledger} VALUES ('before', 'taken')"))
    mark = "$1, $2" if how == "asyncpg" else "%s, %s"
    sql = f"INSERT INTO {ledger} (message_id, account) VALUES ({mark})"

    def account(message: Message) -> str:
        return "taken" if message.id == "m3" else f"acct-{message.id}"

    def body(raw: Any, session: Any, message: Message) -> None:
        cursor = raw.cursor()
        try:
            cursor.execute(sql, (message.id, account(message)))
        finally:
            cursor.close()

    async def body_async(raw: Any, session: Any, message: Message) -> None:
        if how == "asyncpg":
            await raw.execute(sql, message.id, account(message))
            return
        await raw.execute(sql, (message.id, account(message)))

    messages = [Message(id=f"m{i}", body=b"{}") for i in range(6)]
    results = _run(db, how, body if how == "sync" else body_async, messages)
    outcomes = {r.message.id: r.outcome for r in results}
    assert outcomes == {
        **{f"m{i}": Outcome.PROCESSED for i in (0, 1, 2, 4, 5)},
        "m3": Outcome.FAILED,
    }
    assert "unique" in str(next(r.error for r in results if r.message.id == "m3")).lower()
    with db.engine.connect() as conn:
        rows = sorted(r[0] for r in conn.execute(text(f"SELECT message_id FROM {ledger}")))
    assert rows == ["before", "m0", "m1", "m2", "m4", "m5"]
    assert _records(db) == {
        **{f"m{i}": "processed" for i in (0, 1, 2, 4, 5)},
        "m3": "failed",
    }


def test_outside_a_handler_call_it_is_refused_naming_the_fix(db: Database) -> None:

    with Session(db.engine) as session:
        session.execute(text("SELECT 1"))
        with pytest.raises(ConfigurationError, match="inside a handler"):
            driver_connection(session)


@pytest.mark.parametrize("where", ["records", "next-call"])
def test_sqlite_a_late_raw_rollback_while_the_guard_is_on_commits_nothing(
    sqlite_db: Database, where: str
) -> None:
    """A thread the first handler left running rolls the raw sqlite3 connection back after
    that call returned, then writes once more: sqlite3 begins a new transaction by itself,
    which looks open to every check after it. It acts while the pipeline writes its records
    (check-first), or as the next message's call begins. Before, the COMMIT took the new
    transaction and reported both messages done, the first without its effects. Now the
    guard's authorizer sees the ROLLBACK and the BEGIN: nothing of it commits as theirs.
    (Not covered on SQLite: a thread that acts in the instant between the guard's lift and
    the COMMIT; on psycopg the COMMIT's answer catches that too.)"""
    from sqlalchemy import event

    db = sqlite_db
    ledger = db.create_ledger()
    sql = _insert(db, "sync", ledger)
    dedup = Deduplicator(db.engine, consumer="driver", tables=db.tables)
    held: dict[str, Any] = {}
    fired: list[bool] = []
    refused: list[str] = []

    def late_thread(*_args: Any) -> None:
        if fired or "raw" not in held:
            return
        fired.append(True)  # once: in the first attempt only

        def act() -> None:
            raw = held["raw"]
            raw.rollback()
            try:  # outside the pipeline's transaction now: the guard's authorizer denies it
                _send_sync(raw, sql, "late")
            except sqlite3.DatabaseError as error:
                refused.append(str(error))

        thread = threading.Thread(target=act)
        thread.start()
        thread.join()

    @dedup.handler(claim_first=where != "records")
    def handle(message: Message, session: Any) -> None:
        raw = driver_connection(session)
        if message.id == "m2" and where == "next-call":
            late_thread()
        _send_sync(raw, sql, message.id or "")
        held.setdefault("raw", raw)

    if where == "records":  # our first statement after the calls: the records
        event.listen(db.engine, "before_cursor_execute", late_thread)
    try:
        results = handle.process_batch([Message(id="m1", body=b"{}"), Message(id="m2", body=b"{}")])
    finally:
        if where == "records":
            event.remove(db.engine, "before_cursor_execute", late_thread)
    assert fired, "the late thread never ran"
    assert refused == ["not authorized"]
    rows, records = _rows(db, ledger), _records(db)
    assert "late" not in rows
    for result in results:
        key = result.message.id or ""
        if result.outcome is Outcome.PROCESSED:  # done: its effects once, its record
            assert rows.count(key) == 1, (key, rows)
            assert records.get(key) == "processed"
        else:  # not done: nothing of it, and a redelivery applies it
            assert rows.count(key) == 0, (key, rows)
    assert any(r.outcome is Outcome.PROCESSED for r in results) or not records


@pytest.mark.parametrize(
    "given",
    ["session", None, 1, True, {"info": {}}, ["session"], object()],
    ids=lambda given: type(given).__name__,  # stable across xdist workers (no address)
)
def test_something_other_than_a_session_is_refused_naming_the_argument(given: object) -> None:
    with pytest.raises(ConfigurationError, match=r"driver_connection\(session\): expected"):
        driver_connection(given)
