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
    named = f"{db.name(column.split('.')[0])}.{column.split('.')[1]}"
    try:
        require_startup(db.engine, db.tables)
    except ConfigurationError as refused:
        said = str(refused)
        assert named in said and ("ALTER TABLE" in said or "init-db" in said), said
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
