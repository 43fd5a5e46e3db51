"""Round 11 attacks on the Kafka runner with offsets in the database (issue 36): records.

On the real broker (Tansu) and PostgreSQL, through the public API only. What must hold in
this mode as in the default one: a RETRY holds its partition (the offset stops before it,
nothing behind it is applied first); a handler that swallows a database error is not
reported done; a FAILED record is recorded and dead-lettered once, a restart does not run
it again; a bulk handler's named culprit fails alone; a record whose id the database cannot
hold is refused and moved past; another group's offsets are its own; the table missing or
stale is a setup fault; a hundred partitions are each taken and moved.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text

from consumerdedup import (
    AsyncDeduplicator,
    BatchMessageFailed,
    ConfigurationError,
    Message,
    Outcome,
    PermanentError,
    RetryLater,
)
from tests.kafka.test_offsets_in_database import (
    DEADLINE,
    QUICK,
    applied,
    events,
    ledger_handler,
    make_runner,
    stored,
)
from tests.support.cli import Cli, cli_fixture  # noqa: F401
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)

pytestmark = pytest.mark.postgres
CLAIMS = pytest.mark.parametrize("claim_ids", [False, True], ids=["offsets-only", "with-claims"])


def failed_records(pg: Any) -> list[tuple[str, str]]:
    with pg.engine.connect() as conn:
        rows = conn.exec_driver_sql(
            f"SELECT message_id, outcome FROM {pg.name('processed_events')} "
            "WHERE outcome = 'failed' ORDER BY 1"
        ).all()
    return [(r[0], r[1]) for r in rows]


async def dead_ids(topics: Topics, topic: str) -> list[bytes]:
    return [dict(r.headers)["event_id"] for r in await topics.records(topic + ".dlq")]


@CLAIMS
async def test_a_retry_holds_its_partition_and_the_offset_stops_before_it(
    kafka: KafkaService, topics: Topics, pg: Any, claim_ids: bool
) -> None:
    """e-0003 asks to be retried (RetryLater) until its attempts in process are spent: it
    ends RETRY. 0..2 commit; when e-0003 comes again the database's offset is 3 (not past
    it) and nothing behind it was applied; then each once, in order."""
    ledger = pg.create_ledger()
    topic = await topics.create("retry")
    group = "retry-" + topic
    await topics.produce_many(topic, events(0, 10))
    engine = pg.async_engine()
    dedup = AsyncDeduplicator(engine, consumer="ledger", tables=pg.tables, retry=QUICK)
    calls: list[str] = []
    seen_again: list[tuple[int | None, list[str]]] = []

    @dedup.handler
    async def handle(message: Message, session: Any) -> None:
        calls.append(message.id)
        if message.id == "e-0003":
            tries = calls.count("e-0003")
            if tries <= QUICK.attempts:
                raise RetryLater("not yet")
            if tries == QUICK.attempts + 1:  # read again by the runner
                seen_again.append((stored(pg, group, topic)[0], applied(pg, ledger)))
        await session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', :n, :m)"),
            {"n": message.json()["n"], "m": message.id},
        )

    try:
        runner = make_runner(kafka, handle, topic, group, batch_size=10, claim_ids=claim_ids)
        await asyncio.wait_for(runner.run(until_idle=True), DEADLINE)
    finally:
        await engine.dispose()
    assert seen_again == [(3, ["e-0000", "e-0001", "e-0002"])]
    first_after = calls.index("e-0004")
    assert max(i for i, m in enumerate(calls) if m == "e-0003") < first_after  # order held
    assert sorted(applied(pg, ledger)) == [eid for eid, _ in events(0, 10)]  # once each
    assert runner.outcomes[Outcome.RETRY] >= 1
    assert stored(pg, group, topic)[0] == 10
    assert await topics.committed(group, topic) == {0: 10}


@CLAIMS
async def test_a_handler_that_swallows_a_database_error_is_not_reported_done(
    kafka: KafkaService, topics: Topics, pg: Any, claim_ids: bool
) -> None:
    """e-0002's handler writes its row, then catches a failed statement and returns: on
    PostgreSQL the transaction is aborted, its COMMIT would be a ROLLBACK. e-0002 must not
    count as applied (its row is gone), its batch-mates are applied once each, e-0002 is
    decided (FAILED: recorded, dead-lettered) and the offset moves past it."""
    ledger = pg.create_ledger()
    topic = await topics.create("swallow")
    group = "swallow-" + topic
    await topics.produce_many(topic, events(0, 5))
    engine = pg.async_engine()
    dedup = AsyncDeduplicator(engine, consumer="ledger", tables=pg.tables, retry=QUICK)

    @dedup.handler
    async def handle(message: Message, session: Any) -> None:
        await session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', :n, :m)"),
            {"n": message.json()["n"], "m": message.id},
        )
        if message.id == "e-0002":
            with contextlib.suppress(Exception):  # the attack: swallowed, and it returns
                await session.execute(text("SELECT 1 / 0"))

    try:
        runner = make_runner(kafka, handle, topic, group, batch_size=5, claim_ids=claim_ids)
        await asyncio.wait_for(runner.run(until_idle=True), DEADLINE)
    finally:
        await engine.dispose()
    assert sorted(applied(pg, ledger)) == ["e-0000", "e-0001", "e-0003", "e-0004"]
    assert runner.outcomes[Outcome.PROCESSED] == 4
    assert runner.outcomes[Outcome.FAILED] == 1
    assert failed_records(pg) == [("e-0002", "failed")]
    assert await dead_ids(topics, topic) == [b"e-0002"]
    assert stored(pg, group, topic)[0] == 5


@CLAIMS
async def test_a_failed_record_is_not_run_again_after_a_restart(
    kafka: KafkaService, topics: Topics, pg: Any, claim_ids: bool
) -> None:
    """A FAILED record is recorded and dead-lettered once; a restart reads nothing again."""
    ledger = pg.create_ledger()
    topic = await topics.create("failrestart")
    group = "failrestart-" + topic
    stream = events(0, 4)
    stream[1] = ("e-0001", json.dumps({"n": 1, "fail": True}).encode())
    await topics.produce_many(topic, stream)
    engine = pg.async_engine()
    calls: list[list[str]] = [[], []]
    try:
        for run in calls:  # the second run is the restart
            handle = ledger_handler(engine, pg.tables, ledger, "a", run)
            runner = make_runner(kafka, handle, topic, group, batch_size=4, claim_ids=claim_ids)
            await asyncio.wait_for(runner.run(until_idle=True), DEADLINE)
    finally:
        await engine.dispose()
    assert "e-0001" in calls[0]
    assert calls[1] == []  # nothing read again, the FAILED record not run again
    assert sorted(applied(pg, ledger)) == ["e-0000", "e-0002", "e-0003"]
    assert failed_records(pg) == [("e-0001", "failed")]
    assert await dead_ids(topics, topic) == [b"e-0001"]  # once, not again at the restart
    assert stored(pg, group, topic)[0] == 4


@CLAIMS
async def test_a_bulk_handlers_named_culprit_fails_alone(
    kafka: KafkaService, topics: Topics, pg: Any, claim_ids: bool
) -> None:
    """The bulk handler names e-0005 (BatchMessageFailed with a PermanentError): it alone
    ends FAILED (recorded, dead-lettered), its chunk-mates are applied once each in the
    next call, and the offset is past all of them."""
    ledger = pg.create_ledger()
    topic = await topics.create("culprit")
    group = "culprit-" + topic
    await topics.produce_many(topic, events(0, 8))
    engine = pg.async_engine()
    dedup = AsyncDeduplicator(engine, consumer="ledger", tables=pg.tables, retry=QUICK)
    calls: list[list[str]] = []

    @dedup.bulk_handler
    async def apply(messages: list[Message], session: Any) -> None:
        calls.append([m.id for m in messages])
        for message in messages:
            if message.id == "e-0005":
                raise BatchMessageFailed(message, PermanentError("named"))
            await session.execute(
                text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', :n, :m)"),
                {"n": message.json()["n"], "m": message.id},
            )

    try:
        runner = make_runner(kafka, apply, topic, group, batch_size=8, claim_ids=claim_ids)
        await asyncio.wait_for(runner.run(until_idle=True), DEADLINE)
    finally:
        await engine.dispose()
    mine = [eid for eid, _ in events(0, 8)]
    assert sorted(applied(pg, ledger)) == [m for m in mine if m != "e-0005"]
    assert calls[0] == mine
    assert failed_records(pg) == [("e-0005", "failed")]
    assert await dead_ids(topics, topic) == [b"e-0005"]
    assert stored(pg, group, topic)[0] == 8


@pytest.mark.parametrize(
    "bad_id", [b"e-\x00-nul", "é".encode("latin-1"), b"x" * 256], ids=["nul", "latin1", "256"]
)
async def test_an_id_the_database_cannot_hold_is_refused_and_passed(
    kafka: KafkaService, topics: Topics, pg: Any, bad_id: bytes
) -> None:
    """Offsets only: an event_id with a NUL (PostgreSQL text cannot hold it), not UTF-8, or
    over 255 characters is refused (dead-lettered, nothing recorded); the records around
    it are applied, the offset is past all three, and a restart dead-letters nothing
    again."""
    ledger = pg.create_ledger()
    topic = await topics.create("badid")
    group = "badid-" + topic
    await topics.produce(topic, json.dumps({"n": 0}).encode(), event_id="e-0000")
    await topics.produce(topic, json.dumps({"n": 1}).encode(), event_id=bad_id)
    await topics.produce(topic, json.dumps({"n": 2}).encode(), event_id="e-0002")
    engine = pg.async_engine()
    try:
        for _ in range(2):
            handle = ledger_handler(engine, pg.tables, ledger, "a")
            runner = make_runner(kafka, handle, topic, group, batch_size=3, claim_ids=False)
            await asyncio.wait_for(runner.run(until_idle=True), DEADLINE)
    finally:
        await engine.dispose()
    assert sorted(applied(pg, ledger)) == ["e-0000", "e-0002"]
    assert await dead_ids(topics, topic) == [bad_id]  # once
    assert stored(pg, group, topic)[0] == 3


async def test_another_groups_offsets_are_its_own(
    kafka: KafkaService, topics: Topics, pg: Any
) -> None:
    """Two groups on one topic, one database: the second reads everything from the start
    (its own row), and neither moves the other's offset or epoch."""
    ledger = pg.create_ledger()
    topic = await topics.create("twogroups")
    await topics.produce_many(topic, events(0, 10))
    engine = pg.async_engine()
    try:
        for who in ("g1", "g2"):
            handle = ledger_handler(engine, pg.tables, ledger, who)
            runner = make_runner(kafka, handle, topic, f"{who}-{topic}", claim_ids=False)
            await asyncio.wait_for(runner.run(until_idle=True), DEADLINE)
            if who == "g1":
                g1 = stored(pg, f"g1-{topic}", topic)
    finally:
        await engine.dispose()
    mine = [eid for eid, _ in events(0, 10)]
    assert sorted(applied(pg, ledger, "g1")) == mine
    assert sorted(applied(pg, ledger, "g2")) == mine
    assert stored(pg, f"g1-{topic}", topic) == g1
    assert stored(pg, f"g2-{topic}", topic)[0] == 10


@pytest.mark.parametrize("damage", ["missing", "stale"])
async def test_a_missing_or_stale_offsets_table_stops_the_runner_before_any_record(
    kafka: KafkaService, topics: Topics, pg: Any, damage: str
) -> None:
    """consumer_offsets dropped, or made by hand without owner_epoch (an older layout): a
    setup fault (ConfigurationError naming the table) before any record is read; nothing
    applied, nothing recorded, nothing committed to the broker."""
    ledger = pg.create_ledger()
    topic = await topics.create("notable")
    group = "notable-" + topic
    await topics.produce_many(topic, events(0, 3))
    table = pg.name("consumer_offsets")
    with pg.engine.begin() as conn:
        conn.execute(text(f"DROP TABLE {table}"))
        if damage == "stale":
            conn.execute(
                text(
                    f"CREATE TABLE {table} (consumer_group VARCHAR(255), topic VARCHAR(255), "
                    "partition INTEGER, next_offset BIGINT, updated_at TIMESTAMPTZ, "
                    "PRIMARY KEY (consumer_group, topic, partition))"
                )
            )
    engine = pg.async_engine()
    calls: list[str] = []
    try:
        handle = ledger_handler(engine, pg.tables, ledger, "a", calls)
        runner = make_runner(kafka, handle, topic, group, claim_ids=False)
        with pytest.raises(ConfigurationError, match="consumer_offsets"):
            await asyncio.wait_for(runner.run(until_idle=True), DEADLINE)
    finally:
        await engine.dispose()
    assert calls == [] and applied(pg, ledger) == []
    assert await topics.committed(group, topic) == {0: 0}


async def test_a_hundred_partitions_are_each_taken_and_moved(
    kafka: KafkaService, topics: Topics, pg: Any
) -> None:
    """100 partitions, 3 records each: one offset row per partition at 3, every record
    applied once, the broker's commits at the ends."""
    ledger = pg.create_ledger()
    topic = await topics.create("hundred", partitions=100)
    group = "hundred-" + topic
    await topics.produce_many(topic, events(0, 300), partitions=100)
    engine = pg.async_engine()
    try:
        handle = ledger_handler(engine, pg.tables, ledger, "a")
        runner = make_runner(
            kafka, handle, topic, group, claim_ids=False, poll_timeout=timedelta(milliseconds=200)
        )
        await asyncio.wait_for(runner.run(until_idle=True), DEADLINE * 2)
    finally:
        await engine.dispose()
    assert sorted(applied(pg, ledger)) == [eid for eid, _ in events(0, 300)]
    with pg.engine.connect() as conn:
        rows = conn.exec_driver_sql(
            f"SELECT partition, next_offset FROM {pg.name('consumer_offsets')} "
            "WHERE consumer_group = %(g)s ORDER BY 1",
            {"g": group},
        ).all()
    assert [tuple(r) for r in rows] == [(p, 3) for p in range(100)]
    assert await topics.committed(group, topic) == dict.fromkeys(range(100), 3)


def test_doctor_names_a_consumer_offsets_column_that_is_missing(pg: Any, cli: Cli) -> None:
    """The layout check covers consumer_offsets: a table without owner_epoch is a FAIL
    naming the column (the runner refuses it at start, above)."""
    table = pg.name("consumer_offsets")
    with pg.engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {table} DROP COLUMN owner_epoch"))
    run = cli(pg, "doctor")
    assert run.returncode != 0, run.stdout
    assert f"{table}.owner_epoch" in run.stdout + run.stderr, run.stdout


async def test_a_failed_record_then_a_retry_in_one_chunk_with_claims(
    kafka: KafkaService, topics: Topics, pg: Any
) -> None:
    """With claims the transactions hold the offset before e-0001 (FAILED) until its dead
    letter is sent; e-0002 ends RETRY in the same chunk. The runner sends the letter, moves
    the offset to 2 (not past the RETRY), and reads e-0002 again: each applied once, one
    letter, the offset at the end."""
    ledger = pg.create_ledger()
    topic = await topics.create("failretry")
    group = "failretry-" + topic
    stream = events(0, 5)
    stream[1] = ("e-0001", json.dumps({"n": 1, "fail": True}).encode())
    await topics.produce_many(topic, stream)
    engine = pg.async_engine()
    dedup = AsyncDeduplicator(engine, consumer="ledger", tables=pg.tables, retry=QUICK)
    calls: list[str] = []
    at_retry: list[int | None] = []

    @dedup.handler
    async def handle(message: Message, session: Any) -> None:
        calls.append(message.id)
        data = message.json()
        if data.get("fail"):
            raise PermanentError("refused by the handler")
        if message.id == "e-0002":
            if calls.count("e-0002") <= QUICK.attempts:
                raise RetryLater("not yet")
            at_retry.append(stored(pg, group, topic)[0])
        await session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', :n, :m)"),
            {"n": data["n"], "m": message.id},
        )

    try:
        runner = make_runner(kafka, handle, topic, group, batch_size=5, claim_ids=True)
        await asyncio.wait_for(runner.run(until_idle=True), DEADLINE)
    finally:
        await engine.dispose()
    assert at_retry == [2]  # past the FAILED record once its letter went, not past the RETRY
    assert sorted(applied(pg, ledger)) == ["e-0000", "e-0002", "e-0003", "e-0004"]
    assert failed_records(pg) == [("e-0001", "failed")]
    assert await dead_ids(topics, topic) == [b"e-0001"]
    assert stored(pg, group, topic)[0] == 5
