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
