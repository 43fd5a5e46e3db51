"""Round 12: the start checks read columns (d0f4b2b); tables that have every column by
name but not as the library writes them.

The contract (DESIGN.md, start checks): a process either runs correctly on the tables it
finds, or refuses at start with ConfigurationError naming ``table.column`` and the fix;
never starts and then fails at its first message. Each test below is that either/or:
the start check refuses naming the column, or a message is processed (and an outbox event
written) on the table as it is.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from consumerdedup import ConfigurationError, Deduplicator, Message, Outbox, Outcome, RetryPolicy
from consumerdedup.startup import require_startup
from tests.conftest import Database, database


@pytest.fixture(params=["postgresql", "mariadb"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    yield from database(request, request.param, tmp_path)


def _alter(db: Database, statement: str) -> None:
    with db.engine.begin() as conn:
        conn.execute(text(statement.format(pe=db.name("processed_events"), ob=db.name("outbox"))))


def _runs_or_refuses(db: Database, column: str) -> None:
    """Refused at start naming ``column`` (a bare name, qualified here), or runs: a message
    processed, its outbox event written, once."""
    table, _, name = column.partition(".")
    named = f"{db.name(table)}.{name}" if name else db.name(table)
    try:
        require_startup(db.engine, db.tables)
    except ConfigurationError as refused:
        said = str(refused)
        fixes = ("ALTER TABLE", "init-db", "migration")
        assert named in said and any(fix in said for fix in fixes), said
        return
    dedup = Deduplicator(db.engine, consumer="c", tables=db.tables, retry=RetryPolicy(attempts=1))
    outbox = Outbox(db.tables)

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        outbox.add(session, "dest", b"{}")

    message = Message(id=f"m-{uuid.uuid4().hex[:8]}", body=b"{}")
    try:
        result = handle.process(message)
    except Exception as error:  # the hole: started, then failed here
        pytest.fail(f"started, then the first message failed: {error!r}")
    assert result.outcome is Outcome.PROCESSED, result


def test_an_extra_not_null_column_without_a_default(db: Database) -> None:
    _alter(db, "ALTER TABLE {pe} ADD COLUMN tenant VARCHAR(20) NOT NULL")
    _runs_or_refuses(db, "processed_events.tenant")


def test_an_outbox_extra_not_null_column_without_a_default(db: Database) -> None:
    _alter(db, "ALTER TABLE {ob} ADD COLUMN tenant VARCHAR(20) NOT NULL")
    _runs_or_refuses(db, "outbox.tenant")


def test_an_extra_nullable_column_or_one_with_a_default_runs(db: Database) -> None:
    _alter(db, "ALTER TABLE {pe} ADD COLUMN note VARCHAR(20)")
    _alter(db, "ALTER TABLE {ob} ADD COLUMN tenant VARCHAR(20) NOT NULL DEFAULT 'x'")
    require_startup(db.engine, db.tables)
    _runs_or_refuses(db, "processed_events.note")


def test_a_nullable_column_of_ours_made_not_null(db: Database) -> None:
    if db.dialect == "mysql":
        _alter(db, "ALTER TABLE {pe} MODIFY error TEXT NOT NULL")
    else:
        _alter(db, "ALTER TABLE {pe} ALTER COLUMN error SET NOT NULL")
    _runs_or_refuses(db, "processed_events.error")


def test_a_column_too_short_for_what_is_written(db: Database) -> None:
    if db.dialect == "mysql":
        _alter(db, "ALTER TABLE {pe} MODIFY outcome VARCHAR(4) NOT NULL")
    else:
        _alter(db, "ALTER TABLE {pe} ALTER COLUMN outcome TYPE VARCHAR(4)")
    _runs_or_refuses(db, "processed_events.outcome")


def test_a_view_in_place_of_processed_events(db: Database) -> None:
    """A view over a complete table (a migration's rename, by hand): refused naming it,
    or it runs."""
    base = db.name("pe_base")
    _alter(db, f"ALTER TABLE {{pe}} RENAME TO {'pe_base' if db.dialect == 'postgresql' else base}")
    _alter(db, f"CREATE VIEW {{pe}} AS SELECT * FROM {base}")
    _runs_or_refuses(db, "processed_events")


def test_consumer_offsets_with_an_extra_not_null_column_stops_a_kafka_runner(
    db: Database,
) -> None:
    """Offsets in the database: the runner's start check (needed=[consumer_offsets]) names
    the column its first offset INSERT would fail on."""
    offsets = db.tables.offsets
    with db.engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {offsets.fullname} ADD COLUMN tenant VARCHAR(20) NOT NULL"))
    with pytest.raises(ConfigurationError) as refused:
        require_startup(db.engine, db.tables, needed=[offsets])
    assert f"{offsets.fullname}.tenant" in str(refused.value), str(refused.value)


def test_a_column_of_another_kind(db: Database) -> None:
    if db.dialect == "mysql":
        _alter(db, "ALTER TABLE {pe} MODIFY payload_hash INTEGER NOT NULL")
    else:
        _alter(db, "ALTER TABLE {pe} ALTER COLUMN payload_hash TYPE INTEGER USING 0")
    _runs_or_refuses(db, "processed_events.payload_hash")
