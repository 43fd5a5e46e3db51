"""Round 5: the Kafka runner's partitions in flight together (issue 20 item 4), with an
async bulk handler whose writes and keyed outbox events are held to COMMIT, while a second
member joins mid-stream: every record's row once, in partition order, every outbox event
once per record, and the group's offsets at the end (nothing committed past what is
recorded, nothing lost)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import func, select

from consumerdedup import AsyncDeduplicator, Message, Outbox, Outcome
from tests.kafka.test_concurrent_partitions import (
    QUICK_RETRY,
    Table,
    fill,
    runner,
    second_joins_mid_run,
)
from tests.support.kafka_service import KafkaService, Topics, kafka_fixture, topics_fixture  # noqa: F401


@pytest.fixture
async def ledger(pg: Any) -> Any:
    made = Table(pg)
    yield made
    for engine in made.engines:
        await engine.dispose()


def bulk(pg: Any, table: Table) -> Any:
    engine = pg.async_engine()
    table.engines.append(engine)
    dedup = AsyncDeduplicator(engine, consumer="ledger", tables=pg.tables, retry=QUICK_RETRY)
    outbox = Outbox(pg.tables)

    @dedup.bulk_handler
    async def place(messages: list[Message], session: Any) -> None:
        await asyncio.sleep(0.02)  # work, so that chunks are in flight at the rebalance
        await session.execute(table.insert, [table.values(m) for m in messages])
        for m in messages:  # keys shared across partitions: held back, locked in one order
            await outbox.add(session, "out", m.id.encode(), key=f"k{int(m.id[2:]) % 7}")

    return place


async def test_a_rebalance_with_bulk_handlers_in_flight_loses_and_doubles_nothing(
    kafka: KafkaService, topics: Topics, pg: Any, ledger: Table
) -> None:
    table = ledger
    topic, ids = await fill(topics, "bulkrebal", 600, later=150)
    group = "group-" + topic
    first, second = (
        runner(kafka, bulk(pg, table), topic, group_id=group, batch_size=20) for _ in range(2)
    )
    await second_joins_mid_run(first, second, table, ids, topics, topic, group, after=80, later=150)
    table.assert_each_once_in_partition_order(ids)
    ob = pg.tables.outbox
    with pg.engine.connect() as conn:
        per_body = conn.execute(
            select(ob.c.body, func.count()).group_by(ob.c.body).having(func.count() > 1)
        ).all()
        total = conn.execute(select(func.count()).select_from(ob)).scalar()
    assert per_body == [] and total == len(ids)
    assert first.outcomes.get(Outcome.FAILED, 0) == second.outcomes.get(Outcome.FAILED, 0) == 0
    assert second.outcomes.get(Outcome.PROCESSED, 0) > 0, "the second runner never got a partition"
