"""Round 11 attacks on MySQL/MariaDB: transaction control through the raw PyMySQL/aiomysql
connection (``session.connection().connection.driver_connection``), below SQLAlchemy.

Before: only its ``commit()`` was refused. ``cursor().execute("COMMIT")`` and
``query("COMMIT")`` committed the claim and the handler's earlier writes (found at the next
statement, the claim deleted, the retry wrote them again: FAILED with its effects twice);
``begin()`` (a BEGIN commits the transaction so far) went unseen: a handler that then
raised was reported DUPLICATE with its first half committed and its record 'processed';
``autocommit(True)`` committed the writes with no record at all. Every route a cursor
of theirs takes goes through the connection's ``query()``, now read before it is sent;
``begin()`` and ``autocommit(True)`` are refused for the call.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from consumerdedup import AsyncDeduplicator, Deduplicator, Message, Outcome
from tests.conftest import Database
from tests.core.test_mysql import rows

SYNC_ROUTES: dict[str, Callable[[Any], Any]] = {
    "cursor COMMIT": lambda raw: raw.cursor().execute("COMMIT"),
    "query COMMIT": lambda raw: raw.query("COMMIT"),
    "cursor /*!COMMIT*/": lambda raw: raw.cursor().execute("/*!COMMIT*/"),
    "cursor DDL": lambda raw: raw.cursor().execute("CREATE TABLE {other} (a INT)"),
    "callproc": lambda raw: raw.cursor().callproc("{proc}"),
    "begin": lambda raw: raw.begin(),
    "autocommit": lambda raw: raw.autocommit(True),
}


async def _cursor(raw: Any, sql: str) -> None:
    async with raw.cursor() as cursor:
        await cursor.execute(sql)


async def _callproc(raw: Any, name: str) -> None:
    async with raw.cursor() as cursor:
        await cursor.callproc(name)


ASYNC_ROUTES: dict[str, Callable[[Any], Awaitable[Any]]] = {
    "cursor COMMIT": lambda raw: _cursor(raw, "COMMIT"),
    "query COMMIT": lambda raw: raw.query("COMMIT"),
    "cursor /*!COMMIT*/": lambda raw: _cursor(raw, "/*!COMMIT*/"),
    "cursor DDL": lambda raw: _cursor(raw, "CREATE TABLE {other} (a INT)"),
    "callproc": lambda raw: _callproc(raw, "{proc}"),
    "begin": lambda raw: raw.begin(),
    "autocommit": lambda raw: raw.autocommit(True),
}


def setup(db: Database) -> tuple[str, dict[str, str]]:
    ledger = db.create_ledger()
    proc = db.name("commits")
    with db.engine.begin() as conn:
        conn.execute(text(f"CREATE PROCEDURE {proc}() BEGIN COMMIT; END"))
    return ledger, {"other": db.name(f"other_{uuid.uuid4().hex[:8]}"), "proc": proc}


def assert_failed_without_effects(db: Database, ledger: str, outcome: Outcome) -> None:
    assert outcome is Outcome.FAILED
    assert rows(db, f"SELECT message_id FROM {ledger}") == []
    assert rows(db, f"SELECT message_id, outcome FROM {db.name('processed_events')}") == [
        ("m-1", "failed")
    ]


class Route:
    """A route's SQL names filled in, on whatever raw connection it is given."""

    def __init__(self, route: Callable[[Any], Any], names: dict[str, str]) -> None:
        self.route, self.names = route, names

    def __call__(self, raw: Any) -> Any:
        return self.route(_Formatting(raw, self.names))


class _Formatting:
    """The raw connection, its SQL and procedure names formatted with the test's names."""

    def __init__(self, raw: Any, names: dict[str, str]) -> None:
        self._raw, self._names = raw, names

    def cursor(self) -> Any:
        return _Formatting(self._raw.cursor(), self._names)

    async def __aenter__(self) -> Any:
        return _Formatting(await self._raw.__aenter__(), self._names)

    async def __aexit__(self, *exc: Any) -> Any:
        return await self._raw.__aexit__(*exc)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._raw, name)
        if name not in ("execute", "query", "callproc"):
            return method
        return lambda sql, *a, **k: method(sql.format(**self._names), *a, **k)


@pytest.mark.parametrize("raises", [False, True], ids=["returns", "raises"])
@pytest.mark.parametrize("route", list(SYNC_ROUTES))
def test_transaction_control_on_the_raw_pymysql_connection(
    mariadb: Database, route: str, raises: bool
) -> None:
    ledger, names = setup(mariadb)
    engine = create_engine(mariadb.url, pool_size=1, max_overflow=0)
    dedup = Deduplicator(engine, consumer="c", tables=mariadb.tables)
    insert = text(f"INSERT INTO {ledger} (message_id) VALUES (:m)")
    misbehave = Route(SYNC_ROUTES[route], names)

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        session.execute(insert, {"m": f"{message.id}-before"})
        try:
            misbehave(session.connection().connection.driver_connection)
        except Exception:
            if raises:
                raise
        if raises:
            raise RuntimeError("the handler fails after it")
        session.execute(insert, {"m": f"{message.id}-after"})

    try:
        assert_failed_without_effects(mariadb, ledger, handle(Message(id="m-1", body=b"x")))
        # The one pooled connection is fit for the next message: in a transaction of ours,
        # not in autocommit, and its raw methods are its own again.
        ok = dedup.handler(lambda m, s: s.execute(insert, {"m": m.id}))
        assert ok(Message(id="m-2", body=b"x")) is Outcome.PROCESSED
    finally:
        engine.dispose()
    assert rows(mariadb, f"SELECT message_id FROM {ledger}") == [("m-2",)]


@pytest.mark.parametrize("raises", [False, True], ids=["returns", "raises"])
@pytest.mark.parametrize("route", list(ASYNC_ROUTES))
def test_transaction_control_on_the_raw_aiomysql_connection(
    mariadb: Database, route: str, raises: bool
) -> None:
    ledger, names = setup(mariadb)
    insert = text(f"INSERT INTO {ledger} (message_id) VALUES (:m)")
    misbehave = Route(ASYNC_ROUTES[route], names)

    async def main() -> tuple[Outcome, Outcome]:
        engine = mariadb.async_engine()
        dedup = AsyncDeduplicator(engine, consumer="c", tables=mariadb.tables)

        @dedup.handler
        async def handle(message: Message, session: Any) -> None:
            await session.execute(insert, {"m": f"{message.id}-before"})
            conn = await session.connection()
            raw = (await conn.get_raw_connection()).driver_connection
            try:
                await misbehave(raw)
            except Exception:
                if raises:
                    raise
            if raises:
                raise RuntimeError("the handler fails after it")
            await session.execute(insert, {"m": f"{message.id}-after"})

        @dedup.handler
        async def ok(message: Message, session: Any) -> None:
            await session.execute(insert, {"m": message.id})

        try:
            return await handle(Message(id="m-1", body=b"x")), await ok(
                Message(id="m-2", body=b"x")
            )
        finally:
            await engine.dispose()

    first, second = asyncio.run(main())
    assert first is Outcome.FAILED
    assert second is Outcome.PROCESSED
    assert rows(mariadb, f"SELECT message_id FROM {ledger}") == [("m-2",)]
    assert sorted(
        rows(mariadb, f"SELECT message_id, outcome FROM {mariadb.name('processed_events')}")
    ) == [("m-1", "failed"), ("m-2", "processed")]


@pytest.mark.parametrize("method", ["select_db", "set_character_set"])
def test_the_raw_connections_session_changes_are_refused(mariadb: Database, method: str) -> None:
    """PyMySQL's ``select_db()`` and ``set_character_set()`` change what later messages on
    the pooled connection inherit (where unqualified tables are, how keys are read)."""
    ledger, _names = setup(mariadb)
    engine = create_engine(mariadb.url, pool_size=1, max_overflow=0)
    dedup = Deduplicator(engine, consumer="c", tables=mariadb.tables)
    insert = text(f"INSERT INTO {ledger} (message_id) VALUES (:m)")

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        session.execute(insert, {"m": f"{message.id}-before"})
        getattr(session.connection().connection.driver_connection, method)("latin1")

    try:
        assert_failed_without_effects(mariadb, ledger, handle(Message(id="m-1", body=b"x")))
    finally:
        engine.dispose()
