"""An engine with a ``schema_translate_map`` is refused, with the fix, before anything is
written.

SQLAlchemy renders a Table's schema through the engine's (or connection's)
``schema_translate_map`` at each execution. consumerdedup's own SQL is built once (sent
straight to psycopg as text, DDL with trigger bodies, the relay's statements): the map
would not apply to it, and the dedup records would go to another schema than the
application's writes they must commit with. So every entry point refuses such an engine
or connection (ConfigurationError naming Tables.define as the fix), and the tests check
that nothing was written anywhere.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session, sessionmaker

from consumerdedup import (
    AsyncDeduplicator,
    ConfigurationError,
    Deduplicator,
    Message,
    OutboxRelay,
    Pruner,
    Tables,
    install,
)
from consumerdedup.testing import MemoryBroker
from tests.conftest import Database


@pytest.fixture
def tenant(pg: Database) -> Iterator[str]:
    schema = f"tenant_{uuid.uuid4().hex[:8]}"
    with pg.engine.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
        conn.execute(text(f"CREATE TABLE {schema}.ledger (message_id TEXT)"))
    yield schema
    with pg.engine.begin() as conn:
        conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))


def _tables_in(pg: Database, schema: str) -> list[str]:
    with pg.engine.connect() as conn:
        return list(
            conn.execute(
                text("SELECT table_name FROM information_schema.tables WHERE table_schema = :s"),
                {"s": schema},
            ).scalars()
        )


def test_install_refuses_a_translated_engine(pg: Database, tenant: str) -> None:
    engine = create_engine(pg.url).execution_options(schema_translate_map={None: tenant})
    with pytest.raises(ConfigurationError, match=r"schema_translate_map.*Tables\.define"):
        install(engine, Tables.define("processed_events", "outbox"))
    assert _tables_in(pg, tenant) == ["ledger"]
    engine.dispose()


def test_the_deduplicators_and_the_relay_refuse_a_translated_engine(
    pg: Database, tenant: str
) -> None:
    engine = create_engine(pg.url).execution_options(schema_translate_map={None: tenant})
    with pytest.raises(ConfigurationError, match="schema_translate_map"):
        Deduplicator(engine, "translated", tables=pg.tables)
    with pytest.raises(ConfigurationError, match="schema_translate_map"):
        OutboxRelay(engine, MemoryBroker(), tables=pg.tables)
    with pytest.raises(ConfigurationError, match="schema_translate_map"):
        Pruner(engine, retention=timedelta(days=7), tables=pg.tables)
    async_engine = create_async_engine(pg.async_url).execution_options(
        schema_translate_map={None: tenant}
    )
    with pytest.raises(ConfigurationError, match="schema_translate_map"):
        AsyncDeduplicator(async_engine, "translated", tables=pg.tables)
    engine.dispose()
    asyncio.run(async_engine.dispose())


def test_a_session_factory_whose_connections_translate_is_refused_at_the_transaction(
    pg: Database, tenant: str
) -> None:
    """The map set on the connection only (a factory binding a translated Connection per
    session): caught when the transaction begins, before the claim; nothing recorded."""
    ledger = f"{tenant}.ledger"

    def translated_sessions() -> Session:
        conn = pg.engine.connect().execution_options(schema_translate_map={None: tenant})
        return sessionmaker(bind=conn)()

    dedup = Deduplicator(
        pg.engine, "translated", tables=pg.tables, session_factory=translated_sessions
    )

    @dedup.handler
    def handle(message: Message, session: Session) -> None:
        session.execute(text(f"INSERT INTO {ledger} VALUES (:m)"), {"m": message.id})

    with pytest.raises(ConfigurationError, match="schema_translate_map"):
        handle(Message(id="m1", body=b"{}"))
    assert pg.scalar(f"SELECT count(*) FROM {ledger}") == 0
    assert pg.scalar(f"SELECT count(*) FROM {pg.name('processed_events')}") == 0


def test_an_async_session_factory_whose_connections_translate_is_refused(
    pg: Database, tenant: str
) -> None:
    ledger = f"{tenant}.ledger"

    async def go() -> None:
        engine = create_async_engine(pg.async_url)
        translated = engine.execution_options(schema_translate_map={None: tenant})

        def translated_sessions() -> AsyncSession:
            return AsyncSession(translated)

        dedup = AsyncDeduplicator(
            engine, "translated", tables=pg.tables, session_factory=translated_sessions
        )

        @dedup.handler
        async def handle(message: Message, session: AsyncSession) -> None:
            await session.execute(text(f"INSERT INTO {ledger} VALUES (:m)"), {"m": message.id})

        with pytest.raises(ConfigurationError, match="schema_translate_map"):
            await handle(Message(id="m1", body=b"{}"))
        await engine.dispose()

    asyncio.run(go())
    assert pg.scalar(f"SELECT count(*) FROM {ledger}") == 0
    assert pg.scalar(f"SELECT count(*) FROM {pg.name('processed_events')}") == 0
