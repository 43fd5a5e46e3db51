"""Round 11 attack: kill -9 of a runner with offsets in the database (issue 36) between a
chunk's database COMMIT and what follows it, when the chunk holds a FAILED record.

The worker is tests/kafka/test_offsets_in_database.py run as a script: batch_size 10, it
kills itself (SIGKILL) in its third before_ack, that is after the third chunk's COMMIT and
before anything the runner does after it (the dead letters, the broker commit). The third
chunk (20..29) holds e-0025, which fails for good.

docs/kafka.md said a crash anywhere after the database COMMIT costs nothing. For the FAILED
record's dead letter it did: the offset in the database was past e-0025, so the restart
never read it again, and nothing else sent its dead letter. With claims the chunk's
transactions now stop the offset before the first FAILED record and the runner moves it on
once the dead letter is sent: read again, e-0025 is answered by its FAILED record
(RecordedFailure) and dead-lettered, its batch-mates DUPLICATE. Offsets only too: the
records applied behind the FAILED one get theirs, and the first chunk read after the
partition is taken looks its first record up (claimed if it has a record).

Also: kill -9 inside a handler, its row written and the chunk not committed (this module
run as a script is that worker): nothing of the chunk stands, the restart applies it once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from consumerdedup import Tables
from consumerdedup.adapters.kafka import KafkaConfig, KafkaConsumerRunner
from tests.kafka.test_offsets_in_database import (
    DEADLINE,
    FAST,
    ROOT,
    applied,
    events,
    ledger_handler,
    make_runner,
    stored,
)
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)

pytestmark = pytest.mark.postgres


@pytest.mark.parametrize("claim_ids", [False, True], ids=["offsets-only", "with-claims"])
async def test_kill_9_after_the_commit_of_a_chunk_with_a_failed_record_keeps_its_dead_letter(
    kafka: KafkaService, topics: Topics, pg: Any, claim_ids: bool
) -> None:
    ledger = pg.create_ledger()
    topic = await topics.create("kill9dlq")
    stream = events(0, 40)
    stream[25] = ("e-0025", json.dumps({"n": 25, "fail": True}).encode())
    await topics.produce_many(topic, stream)
    group = "kill9dlq-" + topic
    command = [sys.executable, "-m", "tests.kafka.test_offsets_in_database", kafka.bootstrap]
    command += [topic, group, pg.async_url, pg.schema, ledger]
    command += [json.dumps(dict(kafka.group_options)), str(int(kafka.idempotence))]
    command += [str(int(claim_ids))]
    worker = subprocess.Popen(command, cwd=ROOT)
    try:
        assert worker.wait(DEADLINE) == -signal.SIGKILL  # killed itself in its third before_ack
    finally:
        if worker.poll() is None:
            worker.kill()
    # The third chunk committed, e-0025 FAILED in it: its offset waits for the dead letter.
    assert stored(pg, group, topic)[0] == 25
    assert await topics.records(topic + ".dlq") == []  # killed before its dead letter

    engine = pg.async_engine()
    try:
        restarted = make_runner(
            kafka,
            ledger_handler(engine, pg.tables, ledger, "restart"),
            topic,
            group,
            batch_size=10,
            claim_ids=claim_ids,
        )
        await asyncio.wait_for(restarted.run(until_idle=True), DEADLINE)
    finally:
        await engine.dispose()
    mine = [eid for eid, _ in stream if eid != "e-0025"]
    assert sorted(applied(pg, ledger)) == mine  # once each: this part holds
    assert stored(pg, group, topic)[0] == 40
    dead = [dict(r.headers)["event_id"] for r in await topics.records(topic + ".dlq")]
    assert dead == [b"e-0025"]  # the dead letter of the FAILED record is not lost


@pytest.mark.parametrize("claim_ids", [False, True], ids=["offsets-only", "with-claims"])
async def test_kill_9_between_the_handlers_writes_and_the_commit(
    kafka: KafkaService, topics: Topics, pg: Any, claim_ids: bool
) -> None:
    """The worker kills itself inside e-0025's handler, its ledger row written and not
    committed: nothing of that chunk stands (no ledger row, no offset, no claim); the
    restart reads from 20 and applies each record once."""
    ledger = pg.create_ledger()
    topic = await topics.create("kill9mid")
    await topics.produce_many(topic, events(0, 40))
    group = "kill9mid-" + topic
    command = [sys.executable, "-m", "tests.attacks.test_round11_kafka_offsets_kill"]
    command += [kafka.bootstrap, topic, group, pg.async_url, pg.schema, ledger]
    command += [json.dumps(dict(kafka.group_options)), str(int(kafka.idempotence))]
    command += [str(int(claim_ids))]
    worker = subprocess.Popen(command, cwd=ROOT)
    try:
        assert worker.wait(DEADLINE) == -signal.SIGKILL
    finally:
        if worker.poll() is None:
            worker.kill()
    mine = [eid for eid, _ in events(0, 40)]
    assert sorted(applied(pg, ledger)) == mine[:20]
    assert stored(pg, group, topic)[0] == 20
    engine = pg.async_engine()
    calls: list[str] = []
    try:
        restarted = make_runner(
            kafka,
            ledger_handler(engine, pg.tables, ledger, "restart", calls),
            topic,
            group,
            batch_size=10,
            claim_ids=claim_ids,
        )
        await asyncio.wait_for(restarted.run(until_idle=True), DEADLINE)
    finally:
        await engine.dispose()
    assert calls == mine[20:]  # from the database's offset, the killed chunk again
    assert sorted(applied(pg, ledger)) == mine  # once each
    assert stored(pg, group, topic)[0] == 40


def _worker(argv: Sequence[str]) -> None:
    """Runs the topic in chunks of 10 and kills itself (SIGKILL) inside e-0025's handler,
    after its ledger row and before the chunk's COMMIT."""
    bootstrap, topic, group, url, schema, ledger, options, idempotence, claim_ids = argv

    async def main() -> None:
        from consumerdedup import AsyncDeduplicator, Message

        engine = create_async_engine(url)
        tables = Tables.define(f"{schema}.processed_events", f"{schema}.outbox")
        dedup = AsyncDeduplicator(engine, consumer="ledger", tables=tables)

        @dedup.handler
        async def handle(message: Message, session: Any) -> None:
            n = message.json()["n"]
            columns = "(account, amount, message_id)"
            insert = f"INSERT INTO {ledger} {columns} VALUES ('worker', :n, :m)"
            await session.execute(text(insert), {"n": n, "m": message.id})
            if n == 25:
                await session.flush()
                os.kill(os.getpid(), signal.SIGKILL)

        config = KafkaConfig(
            batch_size=10,
            partitions_in_flight=1,
            offsets="database",
            claim_ids=bool(int(claim_ids)),
            idempotent_producer=bool(int(idempotence)),
            consumer_options=json.loads(options),
            **FAST,  # type: ignore[arg-type]
        )
        runner = KafkaConsumerRunner(
            handle, topic, bootstrap_servers=bootstrap, group_id=group, config=config
        )
        await runner.run()

    asyncio.run(main())


if __name__ == "__main__":
    _worker(sys.argv[1:])
