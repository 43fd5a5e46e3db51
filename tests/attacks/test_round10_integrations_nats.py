"""Round 10 attack on consumerdedup.faststream.DedupMiddleware on a real NATS JetStream and
PostgreSQL: JetStream delivers a message again after its ack_wait while the first
delivery's handler still runs (two workers in one subscriber): the twin's claim waits on
the first's uncommitted record, then answers DUPLICATE; the effect is applied once."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

import nats
import pytest
from faststream import Context
from faststream.nats import ConsumerConfig, JStream, NatsBroker, NatsRouter
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from consumerdedup import Outcome
from consumerdedup.faststream import NATS_ID_HEADER, SESSION, DedupMiddleware
from tests.conftest import Database
from tests.integrations.faststream_support import (
    DEADLINE,
    Seen,
    deduplicator,
    eventually,
    records,
    rows,
    until,
)
from tests.support import services

NATS_URL = "nats://127.0.0.1:4222"


@pytest.fixture
async def engine(pg: Database) -> AsyncIterator[AsyncEngine]:
    if not services.answers("127.0.0.1", 4222):
        services.unavailable("NATS (JetStream) at 127.0.0.1:4222 does not answer")
    engine = pg.async_engine()
    yield engine
    await engine.dispose()


def claim_waits(pg: Database) -> int:
    with pg.engine.connect() as conn:
        return int(
            conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND query LIKE :table"
                ),
                {"table": f"%{pg.tables.processed_events}%"},
            ).scalar_one()
        )


async def test_a_redelivery_after_ack_wait_waits_on_the_claim_then_is_a_duplicate(
    pg: Database, engine: AsyncEngine
) -> None:
    unique = uuid.uuid4().hex[:10]
    stream, subject, durable = f"R10{unique}", f"r10.{unique}", f"d{unique}"
    ledger, seen = pg.create_ledger(), Seen()
    once = DedupMiddleware(deduplicator(pg, engine, seen))
    router = NatsRouter(middlewares=[once])
    release = asyncio.Event()
    calls: list[Any] = []

    @router.subscriber(
        subject,
        stream=JStream(stream, subjects=[subject]),
        durable=durable,
        config=ConsumerConfig(ack_wait=1.0, max_deliver=5),
        max_workers=2,
    )
    async def charge(
        body: dict[str, Any], session: Annotated[AsyncSession, Context(SESSION)]
    ) -> None:
        calls.append(body)
        await session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', :n, :r)"),
            {"n": body["amount"], "r": body["ref"]},
        )
        await asyncio.wait_for(release.wait(), DEADLINE)  # past ack_wait: redelivered

    broker = NatsBroker(NATS_URL, logger=None)
    broker.include_router(router)
    client = await nats.connect(NATS_URL)
    try:
        async with broker:
            await broker.start()
            await client.jetstream().publish(
                subject,
                json.dumps({"amount": 3, "ref": "j-1"}).encode(),
                headers={NATS_ID_HEADER: "j-1"},
            )
            await until(lambda: len(calls) == 1, "the first delivery's handler running")
            # JetStream redelivers after ack_wait; the twin's claim waits on the first's row
            await until(lambda: claim_waits(pg) > 0, "the redelivery waiting on the claim")
            release.set()
            await until(lambda: len(seen.results) >= 2, "both deliveries decided")

            async def unacked() -> tuple[int, int]:
                info = await client.jetstream().consumer_info(stream, durable)
                return info.num_pending or 0, info.num_ack_pending or 0

            await eventually(unacked, (0, 0), "nothing pending or unacked")
    finally:
        release.set()
        await client.jetstream().delete_stream(stream)
        await client.close()
    assert len(calls) == 1  # the twin's handler never ran
    outcomes = seen.outcomes()  # the twin may report before the first: order not asserted
    assert outcomes.count(Outcome.PROCESSED) == 1
    assert outcomes.count(Outcome.DUPLICATE) == len(outcomes) - 1 >= 1
    assert rows(pg, ledger) == [("j-1", 3)]
    assert records(pg) == [("j-1", "processed")]
