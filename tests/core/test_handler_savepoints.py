"""A handler's own ``session.begin_nested()`` works, on PostgreSQL and SQLite, sync and async.

Its RELEASE fires SQLAlchemy's before_commit like a commit does; only a real
commit inside a handler is refused.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

from consumerdedup import AsyncDeduplicator, Deduplicator, Message, Outcome
from consumerdedup.errors import CommitInHandler
from tests.conftest import Database


def ledger_ids(db: Database, ledger: str) -> list[str]:
    with db.engine.connect() as conn:
        return sorted(r[0] for r in conn.exec_driver_sql(f"SELECT message_id FROM {ledger}"))


def test_a_released_savepoint_commits_with_the_record(db: Database) -> None:
    ledger = db.create_ledger()
    insert = text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', 1, :m)")
    dedup = Deduplicator(db.engine, "ledger", tables=db.tables)

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        with session.begin_nested():
            session.execute(insert, {"m": message.id})
        if message.body == b"commit":
            with session.begin_nested():
                session.commit()

    assert handle.batch([Message("m-1", b"{}"), Message("m-2", b"{}")]) == [Outcome.PROCESSED] * 2
    result = handle.process(Message("m-3", b"commit"))
    assert result.outcome is Outcome.FAILED and isinstance(result.error, CommitInHandler)
    assert ledger_ids(db, ledger) == ["m-1", "m-2"]


async def test_a_released_savepoint_commits_with_the_record_async(db: Database) -> None:
    ledger = db.create_ledger()
    insert = text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', 1, :m)")
    engine = db.async_engine()
    dedup = AsyncDeduplicator(engine, "ledger", tables=db.tables)

    @dedup.handler
    async def handle(message: Message, session: Any) -> None:
        async with session.begin_nested():
            await session.execute(insert, {"m": message.id})

    outcomes = await handle.batch([Message("m-1", b"{}"), Message("m-2", b"{}")])
    assert outcomes == [Outcome.PROCESSED] * 2
    assert ledger_ids(db, ledger) == ["m-1", "m-2"]
    await engine.dispose()
