"""The start checks read the columns of the tables a process uses, as doctor does: a
processed_events or outbox made by hand (or by an older release) without a column stops a
runner or a relay at start with ConfigurationError naming ``table.column`` and the fix,
not at its first statement with the driver's UndefinedColumn. On SQLite, PostgreSQL and
MariaDB; a complete table passes, and a table the process does not use is not its business.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from consumerdedup import (
    AsyncDeduplicator,
    ConfigurationError,
    Deduplicator,
    Message,
    OutboxRelay,
    Outcome,
)
from consumerdedup.startup import OK, require_startup, startup_checks
from consumerdedup.testing import MemoryBroker, MemoryConsumerRunner
from tests.conftest import Database, database


@pytest.fixture(params=["sqlite", "postgresql", "mariadb"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    yield from database(request, request.param, tmp_path)


def drop_column(db: Database, table: str, column: str) -> str:
    """The table as a hand-made one (or an older release's) would be: without ``column``.
    Returns ``table.column`` as the check names it."""
    with db.engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {db.name(table)} DROP COLUMN {column}"))
    return f"{db.name(table)}.{column}"


def runner_of(db: Database, kind: str, broker: MemoryBroker, seen: list[str]) -> Any:
    if kind == "sync":
        dedup = Deduplicator(db.engine, consumer="c", tables=db.tables)

        @dedup.handler
        def handle(message: Message, session: Any) -> None:
            seen.append(message.id)

        return MemoryConsumerRunner(handle, "q", broker=broker)
    # NullPool: each connection closed on its release, in the runner's own event loop
    # (a pooled aiomysql one would be collected after that loop closed).
    engine = create_async_engine(db.async_url, poolclass=NullPool)
    adedup = AsyncDeduplicator(engine, consumer="c", tables=db.tables)

    @adedup.handler
    async def ahandle(message: Message, session: Any) -> None:
        seen.append(message.id)

    return MemoryConsumerRunner(ahandle, "q", broker=broker)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_processed_events_lacking_a_column_stops_the_runner_before_any_fetch(
    db: Database, kind: str
) -> None:
    """``error`` (nullable: init-db adds it) dropped: the runner names it and init-db."""
    missing = drop_column(db, "processed_events", "error")
    broker = MemoryBroker()
    broker.publish("q", b"{}", message_id="m-1")
    seen: list[str] = []
    runner = runner_of(db, kind, broker, seen)
    with pytest.raises(ConfigurationError) as caught:
        runner.run(until_idle=True)
    said = str(caught.value)
    assert f"columns: missing: {missing} (" in said and "consumerdedup init-db" in said, said
    assert (broker.delivered, broker.acked, broker.held("q"), seen) == (0, 0, 1, [])


def test_a_column_init_db_cannot_add_names_the_migration(db: Database) -> None:
    """``payload_hash`` is NOT NULL without a default: install() cannot add it to a table
    with rows, so the fix given is the release's migration, not init-db alone."""
    missing = drop_column(db, "processed_events", "payload_hash")
    with pytest.raises(ConfigurationError) as caught:
        require_startup(db.engine, db.tables, [db.tables.processed_events])
    said = str(caught.value)
    assert f"missing: {missing}" in said and "docs/migrations.md" in said, said
    assert f"cannot add {missing} (NOT NULL, no default)" in said, said


def test_an_outbox_lacking_a_column_stops_the_relay(db: Database) -> None:
    missing = drop_column(db, "outbox", "last_error")
    broker = MemoryBroker()
    relay = OutboxRelay(db.engine, broker, tables=db.tables)
    with pytest.raises(ConfigurationError) as caught:
        relay.drain()
    said = str(caught.value)
    assert f"columns: missing: {missing} (" in said and "consumerdedup init-db" in said, said
    assert broker.published == 0


def test_complete_tables_pass_and_an_unused_one_is_not_read(db: Database) -> None:
    """Every column present: the columns check is OK for every needed set. A consumer that
    does not use the outbox starts and consumes though the outbox lacks a column."""
    tables = db.tables
    for needed in ([tables.processed_events], [tables.outbox], [tables.offsets], None):
        found = {c.name: c for c in startup_checks(db.engine, tables, needed)}
        assert found["columns"].status == OK, found
        require_startup(db.engine, tables, needed)
    drop_column(db, "outbox", "last_error")
    broker = MemoryBroker()
    broker.publish("q", b"{}", message_id="m-1")
    seen: list[str] = []
    runner = runner_of(db, "sync", broker, seen)
    runner.run(until_idle=True)
    assert seen == ["m-1"] and runner.outcomes[Outcome.PROCESSED] == 1
