"""An engine or session in autocommit mode is refused by the outbox and the relay (issue 17, 1).

In autocommit every statement commits on its own: an event added by
``Outbox.add`` would be published although the caller's transaction rolled
back, the per-key advisory lock would be released at once (no order between
same-key producers), and the relay's row and key locks would hold nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from sqlalchemy import Engine, create_engine, func, select
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from consumerdedup import ConfigurationError, Outbox, OutboxRelay
from consumerdedup.testing import MemoryBroker
from tests.conftest import Database


def autocommit_engines(db: Database) -> dict[str, Callable[[], Engine]]:
    """Every way a user can hand us an autocommit PostgreSQL engine."""
    return {
        "create_engine": lambda: create_engine(db.url, isolation_level="AUTOCOMMIT"),
        "execution_options": lambda: create_engine(db.url).execution_options(
            isolation_level="AUTOCOMMIT"
        ),
        "driver connect_args": lambda: create_engine(db.url, connect_args={"autocommit": True}),
    }


def outbox_rows(db: Database) -> int:
    with db.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(db.tables.outbox)).scalar_one())


@pytest.mark.parametrize("how", ["create_engine", "execution_options", "driver connect_args"])
@pytest.mark.parametrize("key", [None, "k"])
def test_outbox_add_refuses_an_autocommit_session(pg: Database, how: str, key: str | None) -> None:
    engine = autocommit_engines(pg)[how]()
    outbox = Outbox(pg.tables)
    try:
        with Session(engine) as session:
            with pytest.raises(ConfigurationError, match="AUTOCOMMIT"):
                outbox.add(session, "events", b"{}", key=key)
            session.rollback()
        assert outbox_rows(pg) == 0, "the event committed on its own, outside any transaction"
    finally:
        engine.dispose()


@pytest.mark.parametrize("key", [None, "k"])
def test_outbox_add_refuses_an_autocommit_async_session(pg: Database, key: str | None) -> None:
    async def attempt() -> None:
        engine = create_async_engine(pg.async_url, isolation_level="AUTOCOMMIT")
        try:
            async with AsyncSession(engine) as session:
                with pytest.raises(ConfigurationError, match="AUTOCOMMIT"):
                    await Outbox(pg.tables).add(session, "events", b"{}", key=key)
        finally:
            await engine.dispose()

    asyncio.run(attempt())
    assert outbox_rows(pg) == 0


def test_outbox_add_refuses_an_autocommit_sqlite_session(sqlite_db: Database) -> None:
    engine = create_engine(sqlite_db.url, isolation_level="AUTOCOMMIT")
    try:
        with Session(engine) as session, pytest.raises(ConfigurationError, match="AUTOCOMMIT"):
            Outbox(sqlite_db.tables).add(session, "events", b"{}")
        assert outbox_rows(sqlite_db) == 0
    finally:
        engine.dispose()


def test_outbox_add_in_an_ordinary_session_still_commits_with_it(db: Database) -> None:
    with Session(db.engine) as session:
        Outbox(db.tables).add(session, "events", b"{}", key="k")
        session.rollback()
    assert outbox_rows(db) == 0
    with Session(db.engine) as session:
        Outbox(db.tables).add(session, "events", b"{}", key="k")
        session.commit()
    assert outbox_rows(db) == 1


@pytest.mark.parametrize("how", ["create_engine", "execution_options"])
def test_the_relay_refuses_an_autocommit_engine_at_construction(pg: Database, how: str) -> None:
    engine = autocommit_engines(pg)[how]()
    try:
        with pytest.raises(ConfigurationError, match=r"OutboxRelay.*AUTOCOMMIT"):
            OutboxRelay(engine, MemoryBroker(), tables=pg.tables)
    finally:
        engine.dispose()


def test_the_relay_refuses_an_autocommit_driver_before_claiming(pg: Database) -> None:
    """The driver's own autocommit shows only on a connection: refused before any row is claimed."""
    with Session(pg.engine) as session:
        Outbox(pg.tables).add(session, "events", b"{}", key="k")
        session.commit()
    engine = create_engine(pg.url, connect_args={"autocommit": True})
    broker = MemoryBroker()
    try:
        relay = OutboxRelay(engine, broker, tables=pg.tables)
        with pytest.raises(ConfigurationError, match="AUTOCOMMIT"):
            relay.run_once()
    finally:
        engine.dispose()
    assert broker.messages("events") == []
