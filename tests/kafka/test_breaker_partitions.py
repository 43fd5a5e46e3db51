"""The circuit breaker across partitions in flight together (issue 38 item 6): they share the
runner's one breaker, so a broken deploy stops every partition, not one at a time; what is
dead-lettered is the threshold plus at most one record per other chunk in flight; nothing
else is committed, and after the fix and a replay each record is applied once."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text

from consumerdedup import CircuitOpen, Deduplicator, Message, RetryPolicy
from consumerdedup.adapters.kafka import KafkaConsumerRunner
from consumerdedup.failed.records import forget
from tests.conftest import Database
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)

PARTITIONS = 3
THRESHOLD = 3


async def test_partitions_in_flight_share_the_breaker(
    pg: Database, kafka: KafkaService, topics: Topics
) -> None:
    topic = await topics.create("breaker", partitions=PARTITIONS)
    events = [(f"e-{i:02d}", json.dumps({"n": i}).encode()) for i in range(30)]
    await topics.produce_many(topic, events, partitions=PARTITIONS)
    ledger = pg.create_ledger()
    broken = {"yes": True}
    zero = timedelta(0)
    retry = RetryPolicy(attempts=1, initial_delay=zero, max_delay=zero, breaker_threshold=THRESHOLD)
    dedup = Deduplicator(pg.engine, consumer="shop", tables=pg.tables, retry=retry)

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        if broken["yes"]:
            raise KeyError("sku")
        session.execute(
            text(f"INSERT INTO {ledger} VALUES ('a', :n, :m)"),
            {"n": message.json()["n"], "m": message.id},
        )

    group = "group-" + topic

    def runner() -> KafkaConsumerRunner:
        config = kafka.config(
            poll_timeout=timedelta(milliseconds=100),
            batch_size=5,
            partitions_in_flight=PARTITIONS,
            retry_delay=zero,
            max_retry_delay=zero,
        )
        return KafkaConsumerRunner(
            handle, topic, bootstrap_servers=kafka.bootstrap, group_id=group, config=config
        )

    first = runner()
    with pytest.raises(CircuitOpen):
        await first.run(until_idle=True)
    dead = [dict(r.headers)["event_id"].decode() for r in await topics.records(topic + ".dlq")]
    # The threshold, plus at most the one record each other chunk in flight had failed.
    assert THRESHOLD <= len(dead) <= THRESHOLD + PARTITIONS - 1, dead
    assert await topics.lag(group, topic) == 30 - len(dead)
    with pg.engine.connect() as conn:
        pe = pg.tables.processed_events.fullname
        rows = dict(conn.execute(text(f"SELECT message_id, outcome FROM {pe}")).all())
        assert rows == dict.fromkeys(dead, "failed")
        assert conn.execute(text(f"SELECT count(*) FROM {ledger}")).scalar() == 0

    broken["yes"] = False  # the fix: a new runner takes the rest
    await runner().run(until_idle=True)
    assert forget(pg.engine, "shop", dead, tables=pg.tables) == dead  # what replay does first
    for event_id in dead:
        n = int(event_id[2:])
        await topics.produce(topic, json.dumps({"n": n}).encode(), event_id=event_id)
    await runner().run(until_idle=True)
    with pg.engine.connect() as conn:
        applied = sorted(r[0] for r in conn.execute(text(f"SELECT message_id FROM {ledger}")))
    assert applied == sorted(eid for eid, _ in events)  # each once
