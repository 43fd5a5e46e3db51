"""consumerdedup.faststream under FastStream's in-memory TestBrokers (how users unit-test
their subscribers), on SQLite and PostgreSQL: the same message twice is applied once on
each broker's test double, and the session reaches the handler through the context."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

import pytest
from faststream import AckPolicy, Context
from faststream.kafka import KafkaBroker, KafkaRouter, TestKafkaBroker
from faststream.nats import NatsBroker, NatsRouter, TestNatsBroker
from faststream.rabbit import RabbitBroker, RabbitRouter, TestRabbitBroker
from faststream.redis import RedisBroker, RedisRouter, StreamSub, TestRedisBroker
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from consumerdedup import Outcome
from consumerdedup.faststream import SESSION, DedupMiddleware
from tests.conftest import Database
from tests.integrations.faststream_support import Seen, deduplicator, records, rows

Body = dict[str, Any]

KINDS: dict[str, tuple[Any, Any, Any, dict[str, Any], dict[str, Any]]] = {
    # kind: broker, router, test broker, subscriber keywords, publish keywords
    "rabbit": (RabbitBroker, RabbitRouter, TestRabbitBroker, {}, {"message_id": "m-1"}),
    "kafka": (
        KafkaBroker, KafkaRouter, TestKafkaBroker,
        {"group_id": "g", "ack_policy": AckPolicy.ACK}, {"headers": {"event_id": "m-1"}},
    ),
    "nats": (NatsBroker, NatsRouter, TestNatsBroker, {}, {"headers": {"Nats-Msg-Id": "m-1"}}),
    "redis": (
        RedisBroker, RedisRouter, TestRedisBroker,
        {"stream": StreamSub("orders", group="g", consumer="c")}, {"headers": {"event_id": "m-1"}},
    ),
}  # fmt: skip


@pytest.fixture
async def engine(db: Database) -> AsyncIterator[AsyncEngine]:
    engine = db.async_engine()
    yield engine
    await engine.dispose()


@pytest.mark.parametrize("kind", sorted(KINDS))
async def test_same_message_twice_is_applied_once(
    db: Database, engine: AsyncEngine, kind: str
) -> None:
    broker_class, router_class, test_broker, subscribe, publish = KINDS[kind]
    seen, ledger = Seen(), db.create_ledger()
    once = DedupMiddleware(deduplicator(db, engine, seen))
    router = router_class(middlewares=[once])
    named = () if kind == "redis" else ("orders",)  # Redis: the stream is in StreamSub

    @router.subscriber(*named, **subscribe)
    async def charge(body: Body, session: Annotated[AsyncSession, Context(SESSION)]) -> str:
        await session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', :n, 'r')"),
            {"n": body["amount"]},
        )
        return "charged"

    broker = broker_class()
    broker.include_router(router)
    target = {"stream": "orders"} if kind == "redis" else {}  # Redis: publish(stream=)
    async with test_broker(broker) as testing:
        await once.check(testing)
        for _ in range(2):
            await testing.publish({"amount": 4}, *named, **target, **publish)
    assert seen.outcomes() == [Outcome.PROCESSED, Outcome.DUPLICATE]
    assert rows(db, ledger) == [("r", 4)]
    assert records(db) == [("m-1", "processed")]
