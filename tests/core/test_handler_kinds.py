"""A handler whose body did not run stops the runner and loses nothing (issue 17 item 5).

A setup fault, not the message's failure (DESIGN invariant 8): no record, no
dead letter, and the broker still holds every message for the fixed handler.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import text

from consumerdedup import AsyncDeduplicator, ConfigurationError, Deduplicator, Message
from consumerdedup.testing import MemoryBroker, MemoryConfig, MemoryConsumerRunner
from tests.conftest import Database
from tests.core.test_pipeline_attacks import create_ledger, effects


def body(ledger: str) -> Any:
    def run_later(message: Message, session: Any) -> Iterator[None]:
        session.execute(text(f"INSERT INTO {ledger} (message_id) VALUES (:m)"), {"m": message.id})
        yield

    return run_later


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_handler_that_hands_back_unrun_work_stops_the_runner_and_keeps_the_messages(
    db: Database, kind: str
) -> None:
    ledger = create_ledger(db)
    later = body(ledger)
    engine = db.async_engine() if kind == "async" else None
    if kind == "sync":
        dedup: Any = Deduplicator(db.engine, "c", tables=db.tables)

        @dedup.handler
        def handle(message: Message, session: Any) -> Any:
            return later(message, session)  # a wrapper that forgot to run what it wraps
    else:
        dedup = AsyncDeduplicator(engine, "c", tables=db.tables)  # type: ignore[arg-type]

        @dedup.handler
        async def handle(message: Message, session: Any) -> Any:  # type: ignore[misc]
            return later(message, session)

    broker = MemoryBroker()
    for i in range(3):
        broker.publish("orders", b"{}", message_id=f"m{i}")
    runner = MemoryConsumerRunner(
        handle, "orders", broker=broker, config=MemoryConfig(batch_size=2)
    )
    try:
        with pytest.raises(ConfigurationError, match="body did not run"):
            runner.run(until_idle=True)
    finally:
        if engine is not None:
            asyncio.run(engine.dispose())
    assert effects(db, ledger) == []
    with db.engine.connect() as conn:
        assert conn.execute(db.tables.processed_events.select()).all() == []
    assert broker.held("orders") == 3, "every message is still there for the fixed handler"
    assert broker.messages("orders.dlq") == []


@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_handler_session_on_a_second_connection_is_a_setup_fault(
    db: Database, kind: str, claim_first: bool
) -> None:
    """Issue 17 item 3: a write on another connection of the handler's session (several binds,
    bind_arguments) would commit apart from the dedup record. Refused before it is sent,
    whatever the handler makes of the error; the runner stops, nothing is recorded."""
    from sqlalchemy import create_engine

    ledger = create_ledger(db)
    insert = text(f"INSERT INTO {ledger} (message_id) VALUES (:m)")
    if kind == "sync":
        other: Any = create_engine(db.url)
        dedup: Any = Deduplicator(db.engine, "c", tables=db.tables)

        @dedup.handler(claim_first=claim_first)
        def handle(message: Message, session: Any) -> None:
            with contextlib.suppress(Exception):  # swallowed: still refused
                session.execute(insert, {"m": message.id}, bind_arguments={"bind": other})

        def process() -> Any:
            return handle.process(Message(id="m1", body=b"{}"))
    else:
        other = db.async_engine()
        engine = db.async_engine()
        dedup = AsyncDeduplicator(engine, "c", tables=db.tables)

        @dedup.handler(claim_first=claim_first)
        async def handle(message: Message, session: Any) -> None:  # type: ignore[misc]
            bind = {"bind": other.sync_engine}
            await session.execute(insert, {"m": message.id}, bind_arguments=bind)

        def process() -> Any:
            async def go() -> Any:
                try:
                    return await handle.process(Message(id="m1", body=b"{}"))
                finally:
                    await engine.dispose()
                    await other.dispose()

            return asyncio.run(go())

    try:
        with pytest.raises(ConfigurationError, match="second connection"):
            process()
    finally:
        if kind == "sync":
            other.dispose()
    assert effects(db, ledger) == []
    with db.engine.connect() as conn:
        assert conn.execute(db.tables.processed_events.select()).all() == []
