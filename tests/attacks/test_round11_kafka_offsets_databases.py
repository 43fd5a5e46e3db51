"""Round 11 attacks on the Kafka runner with offsets in the database (issue 36), on SQLite
and MariaDB (InnoDB: REPEATABLE READ, no RETURNING) as well as PostgreSQL.

- each database: a FAILED record, a restart with more records: each applied once, the
  FAILED one recorded and dead-lettered once, the offset at the end, nothing read again;
- a zombie on MariaDB and PostgreSQL: its loop frozen in its chunk while the new owner takes
  the partition and applies it; its offset write must change no row (fenced), and a FAILED
  record of its frozen chunk must not be dead-lettered by it (the new owner's one letter).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text

from tests.attacks.test_round11_kafka_offsets import FrozenOwner
from tests.conftest import Database, database
from tests.kafka.test_offsets_in_database import (
    DEADLINE,
    applied,
    events,
    ledger_handler,
    make_runner,
    until,
)
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)

CLAIMS = pytest.mark.parametrize("claim_ids", [False, True], ids=["offsets-only", "with-claims"])


@pytest.fixture(params=["sqlite", "mariadb", "postgresql"])
def any_db(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    yield from database(request, request.param, tmp_path)


@pytest.fixture(params=["mariadb", "postgresql"])
def concurrent_db(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    yield from database(request, request.param, tmp_path)


def stored_at(db: Database, group: str, topic: str) -> tuple[int | None, int]:
    """(next offset, owner epoch) of partition 0 (``partition`` is a keyword in MariaDB:
    the statement is SQLAlchemy's, quoted)."""
    c = db.tables.offsets.c
    where = (c.consumer_group == group, c.topic == topic, c.partition == 0)
    with db.engine.connect() as conn:
        row = conn.execute(select(c.next_offset, c.owner_epoch).where(*where)).one()
    return row[0], row[1]


def failed_ids(db: Database) -> list[str]:
    with db.engine.connect() as conn:
        rows = conn.execute(
            text(f"SELECT message_id FROM {db.name('processed_events')} WHERE outcome = 'failed'")
        ).all()
    return sorted(r[0] for r in rows)


async def dead_ids(topics: Topics, topic: str) -> list[bytes]:
    return [dict(r.headers)["event_id"] for r in await topics.records(topic + ".dlq")]


@CLAIMS
async def test_each_database_applies_once_and_restarts_where_it_stopped(
    kafka: KafkaService, topics: Topics, any_db: Database, claim_ids: bool
) -> None:
    db = any_db
    ledger = db.create_ledger()
    topic = await topics.create("eachdb")
    group = "eachdb-" + topic
    stream = events(0, 20)
    stream[5] = ("e-0005", json.dumps({"n": 5, "fail": True}).encode())
    await topics.produce_many(topic, stream)
    engine = db.async_engine()
    calls: list[list[str]] = [[], []]
    try:
        for run, more in zip(calls, (events(20, 30), []), strict=True):
            handle = ledger_handler(engine, db.tables, ledger, "a", run)
            runner = make_runner(kafka, handle, topic, group, batch_size=4, claim_ids=claim_ids)
            await asyncio.wait_for(runner.run(until_idle=True), DEADLINE)
            if more:
                await topics.produce_many(topic, more)
    finally:
        await engine.dispose()
    mine = [eid for eid, _ in events(0, 30)]
    assert sorted(applied(db, ledger)) == [m for m in mine if m != "e-0005"]
    assert sorted(set(calls[1])) == mine[20:]  # the restart read only what came after
    assert failed_ids(db) == ["e-0005"]
    assert await dead_ids(topics, topic) == [b"e-0005"]
    assert stored_at(db, group, topic)[0] == 30
    assert await topics.committed(group, topic) == {0: 30}


async def test_a_zombie_is_fenced_and_dead_letters_nothing(
    kafka: KafkaService, topics: Topics, concurrent_db: Database
) -> None:
    """Offsets only. The old owner freezes at e-0025 in its chunk 20..29 (e-0027 of which
    fails); the new owner applies 20..49 and dead-letters e-0027. Let go, the old owner's
    chunk (20..26 first, its FAILED record, then the rest) changes no offset row: it rolls
    back whole and sends no dead letter."""
    db = concurrent_db
    ledger = db.create_ledger()
    topic = await topics.create("zdlq")
    stream = events(0, 50)
    stream[27] = ("e-0027", json.dumps({"n": 27, "fail": True}).encode())
    await topics.produce_many(topic, stream)
    group = "zdlq-" + topic
    old = FrozenOwner(kafka, db, ledger, topic, group, claim_ids=False)
    old.start(25)
    engine = db.async_engine()
    new = make_runner(
        kafka,
        ledger_handler(engine, db.tables, ledger, "new"),
        topic,
        group,
        batch_size=10,
        claim_ids=False,
    )
    new_task: asyncio.Task[None] | None = None
    try:
        await until(old.frozen.is_set, "the old owner to freeze in its third chunk")
        assert stored_at(db, group, topic)[0] == 20
        new_task = asyncio.create_task(new.run())
        await until(lambda: stored_at(db, group, topic)[0] == 50, "the new owner to finish")
        await until(lambda: len(applied(db, ledger, "new")) == 29, "the new owner's rows")
        old.thaw.set()
    finally:
        await old.stop()
        new.stop()
        if new_task is not None:
            await asyncio.wait_for(new_task, 30)
        await engine.dispose()
    mine = [eid for eid, _ in stream if eid != "e-0027"]
    assert sorted(applied(db, ledger)) == mine  # once each
    assert sorted(applied(db, ledger, "old")) == mine[:20]
    assert failed_ids(db) == ["e-0027"]
    assert await dead_ids(topics, topic) == [b"e-0027"]  # the new owner's, once
    assert stored_at(db, group, topic)[0] == 50
