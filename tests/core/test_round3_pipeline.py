"""Issue 17, the pipeline's part: what a handler raises is its message's, and no batch stalls.

Each test checks what the database holds (the business table, processed_events)
and what the dead-letter hook heard, on both deduplicators, both claim modes
and both databases.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from consumerdedup import (
    ConfigurationError,
    Deduplicator,
    Message,
    Outbox,
    Outcome,
    Result,
    RetryPolicy,
)
from consumerdedup.errors import HeldBack
from tests.conftest import Database, database

FAST = RetryPolicy(attempts=3, initial_delay=timedelta(0), max_delay=timedelta(0))


@pytest.fixture(params=["sqlite", "postgresql", "postgresql-partitioned"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    yield from database(request, request.param, tmp_path)


def order(mid: str, **data: Any) -> Message:
    return Message(id=mid, body=json.dumps({"n": 1, **data}).encode(), source="orders")


def create_ledger(db: Database) -> str:
    name = db.name("ledger")
    serial = "INTEGER PRIMARY KEY AUTOINCREMENT" if db.dialect == "sqlite" else "SERIAL PRIMARY KEY"
    with db.engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {name} (seq {serial}, message_id TEXT)")
    return name


def effects(db: Database, ledger: str) -> list[str]:
    with db.engine.connect() as conn:
        return [r[0] for r in conn.exec_driver_sql(f"SELECT message_id FROM {ledger} ORDER BY seq")]


def records(db: Database) -> dict[str, tuple[str, str | None]]:
    pe = db.tables.processed_events
    with db.engine.connect() as conn:
        return {r.message_id: (r.outcome, r.error) for r in conn.execute(pe.select())}


Work = Callable[[Message, Any], None]
"""The handler's body on a blocking session; ``awaited`` runs the same on an AsyncSession."""


def wrap(
    flavor: Any, work: Work, awaited: Callable[[Message, Any], Any], **options: Any
) -> Callable[..., list[Result]]:
    """``process_batch`` of a handler running ``work`` (sync) or ``awaited`` (async)."""
    options.setdefault("consumer", "c")
    options.setdefault("retry", FAST)
    dedup = flavor.deduplicator(**options)
    if flavor.name == "sync":
        handle = dedup.handler(claim_first=flavor.claim_first)(work)
        return handle.process_batch  # type: ignore[no-any-return]
    handle = dedup.handler(claim_first=flavor.claim_first)(awaited)

    def process_batch(messages: Sequence[Message], **kw: Any) -> list[Result]:
        return flavor.loop.run_until_complete(handle.process_batch(messages, **kw))  # type: ignore[no-any-return]

    return process_batch


def ledger_sql(ledger: str) -> str:
    return f"INSERT INTO {ledger} (message_id) VALUES (:m)"


# Item 6: a ConfigurationError a handler raises is its message's permanent failure.


def test_a_bad_argument_to_outbox_add_fails_its_message_alone(db: Database, flavor: Any) -> None:
    """The order id is an int in one message: Outbox.add refuses it with ConfigurationError.
    That message is FAILED (recorded, dead-lettered with the reason); its batch-mates commit;
    nothing is raised to the runner."""
    ledger = create_ledger(db)
    outbox = Outbox(db.tables)
    dead: list[Result] = []

    def work(message: Message, session: Any) -> None:
        session.execute(text(ledger_sql(ledger)), {"m": message.id})
        outbox.add(session, "events", b"{}", key=json.loads(message.body)["order"])

    async def awaited(message: Message, session: Any) -> None:
        await session.execute(text(ledger_sql(ledger)), {"m": message.id})
        await outbox.add(session, "events", b"{}", key=json.loads(message.body)["order"])

    process = wrap(flavor, work, awaited, dead_letter=dead.append)
    batch = [order("m1", order="o1"), order("bad", order=2), order("m3", order="o3")]
    results = process(batch)
    assert [r.outcome for r in results] == [Outcome.PROCESSED, Outcome.FAILED, Outcome.PROCESSED]
    assert "ConfigurationError" in (results[1].reason or "")
    assert "key must be None or a str" in (results[1].reason or "")
    assert effects(db, ledger) == ["m1", "m3"]
    stored = records(db)
    assert stored["bad"][0] == "failed" and "key must be None" in (stored["bad"][1] or "")
    assert [r.message.id for r in dead] == ["bad"]
    assert db.scalar(f"SELECT count(*) FROM {db.name('outbox')}") == 2
    again = process(batch)
    assert [r.outcome for r in again] == [Outcome.DUPLICATE, Outcome.FAILED, Outcome.DUPLICATE]
    assert effects(db, ledger) == ["m1", "m3"]


def test_a_handler_of_the_wrong_kind_is_still_a_setup_fault(sqlite_db: Database) -> None:
    """The other side of the line: a ConfigurationError the driver meets on its own (a
    callable that returns a coroutine, given to the blocking Deduplicator) stops the
    caller, and records nothing."""
    dedup = Deduplicator(sqlite_db.engine, consumer="c", tables=sqlite_db.tables, retry=FAST)

    class Handler:
        async def work(self, message: Message, session: Any) -> None:
            pass

        def __call__(self, message: Message, session: Any) -> Any:
            return self.work(message, session)

    handle = dedup.handler(Handler())
    with pytest.raises(ConfigurationError):
        handle.process_batch([order("m1"), order("m2")])
    assert records(sqlite_db) == {}
