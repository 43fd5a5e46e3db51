"""MemoryConsumerRunner runs doctor's start checks as the broker runners do: a database
without consumerdedup's tables stops ``run()`` before anything is fetched; a missing
table of the user's own is not its business."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import text

from consumerdedup import AsyncDeduplicator, ConfigurationError, Deduplicator, Message, Outcome
from consumerdedup.testing import MemoryBroker, MemoryConsumerRunner


def drop(db: Any, table: str) -> None:
    with db.engine.begin() as conn:
        conn.execute(text(f"DROP TABLE {db.name(table)}"))


def handler(db: Any, kind: str, seen: list[str]) -> Any:
    """Records each message it is handed, then writes it to the ledger (if there is one)."""
    ledger = db.name("ledger")
    if kind == "sync":
        dedup = Deduplicator(db.engine, consumer="c", tables=db.tables)

        @dedup.handler
        def handle(message: Message, session: Any) -> None:
            seen.append(message.id)
            session.execute(text(f"INSERT INTO {ledger} VALUES ('a', 1, :m)"), {"m": message.id})

        return handle
    adedup = AsyncDeduplicator(db.async_engine(), consumer="c", tables=db.tables)

    @adedup.handler
    async def ahandle(message: Message, session: Any) -> None:
        seen.append(message.id)
        await session.execute(text(f"INSERT INTO {ledger} VALUES ('a', 1, :m)"), {"m": message.id})

    return ahandle


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_missing_processed_events_stops_run_before_any_fetch(db: Any, kind: str) -> None:
    broker = MemoryBroker()
    broker.publish("q", b"{}", message_id="m-1")
    seen: list[str] = []
    runner = MemoryConsumerRunner(handler(db, kind, seen), "q", broker=broker)
    drop(db, "processed_events")
    with pytest.raises(ConfigurationError) as caught:
        runner.run(until_idle=True)
    said = str(caught.value)
    assert db.tables.processed_events.fullname in said and "consumerdedup init-db" in said
    assert (broker.delivered, broker.acked, broker.held("q"), seen) == (0, 0, 1, [])


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_healthy_start_consumes(db: Any, kind: str) -> None:
    db.create_ledger()
    broker = MemoryBroker()
    broker.publish("q", b"{}", message_id="m-1")
    seen: list[str] = []
    runner = MemoryConsumerRunner(handler(db, kind, seen), "q", broker=broker)
    runner.run(until_idle=True)
    assert seen == ["m-1"] and runner.outcomes[Outcome.PROCESSED] == 1
    assert broker.held("q") == 0 and db.scalar(f"SELECT count(*) FROM {db.name('ledger')}") == 1


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_consumer_needs_only_its_own_table(db: Any, kind: str) -> None:
    """A consumer that never writes outbox events need not have the outbox (or the HTTP
    keys' table): the start check asks for processed_events alone."""
    db.create_ledger()
    broker = MemoryBroker()
    broker.publish("q", b"{}", message_id="m-1")
    seen: list[str] = []
    runner = MemoryConsumerRunner(handler(db, kind, seen), "q", broker=broker)
    drop(db, "outbox")
    drop(db, "idempotency_keys")
    runner.run(until_idle=True)
    assert seen == ["m-1"] and runner.outcomes[Outcome.PROCESSED] == 1


def test_a_database_down_at_start_is_an_outage_not_a_setup_fault() -> None:
    """Only a refused login or a missing table stops a process at start; a database that
    is away is an outage, which the runners and the relay wait out (lifecycle.py)."""
    from sqlalchemy import create_engine
    from sqlalchemy.exc import OperationalError

    from consumerdedup.doctor import WARN, require_startup, startup_checks
    from consumerdedup.retry import ErrorKind, classify

    engine = create_engine("postgresql+psycopg://nobody:pw@127.0.0.1:1/x")
    found = {c.name: c.status for c in startup_checks(engine)}
    assert found["database"] == WARN
    with pytest.raises(OperationalError) as raised:  # the checks did not pass: not ready
        require_startup(engine)
    assert not isinstance(raised.value, ConfigurationError)
    assert classify(raised.value) is ErrorKind.TRANSIENT
