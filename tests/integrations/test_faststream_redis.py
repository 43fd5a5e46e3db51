"""consumerdedup.faststream on a real Redis (streams with a consumer group) and PostgreSQL,
through FastStream's RedisBroker: the id is the event_id header or the stream entry's id."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

import pytest
import redis.asyncio
from faststream import Context
from faststream.redis import ListSub, RedisBroker, RedisRouter, StreamSub
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from consumerdedup import ConfigurationError, Outcome, PermanentError, Result, RetryLater
from consumerdedup.faststream import SESSION, DedupMiddleware
from tests.conftest import Database
from tests.integrations.faststream_support import (
    Seen,
    deduplicator,
    eventually,
    records,
    rows,
    until,
)
from tests.support import services

REDIS_URL = "redis://127.0.0.1:6379"
Body = dict[str, Any]


@pytest.fixture
def redis_url() -> str:
    if not services.answers("127.0.0.1", 6379):
        services.unavailable("Redis at 127.0.0.1:6379 does not answer")
    return REDIS_URL


@pytest.fixture
async def engine(pg: Database) -> AsyncIterator[AsyncEngine]:
    engine = pg.async_engine()
    yield engine
    await engine.dispose()


class Setup:
    """A RedisBroker with one deduplicated stream subscriber (a group of its own)."""

    def __init__(self, url: str, pg: Database, engine: AsyncEngine) -> None:
        unique = uuid.uuid4().hex[:10]
        self.url, self.pg = url, pg
        self.stream, self.group = f"fs-{unique}", f"g-{unique}"
        self.ledger = pg.create_ledger()
        self.seen = Seen()
        self.letters: list[Result] = []
        self.calls: list[Body] = []
        self.before: Callable[[Body], Awaitable[None]] | None = None
        dedup = deduplicator(pg, engine, self.seen, dead_letter=self.letters.append)
        self.once = DedupMiddleware(dedup)

    def broker(self, *sources: Any) -> RedisBroker:
        """Subscribers on ``sources`` (subscriber() keywords), else on the stream's group."""
        broker = RedisBroker(self.url, logger=None)
        router = RedisRouter(middlewares=[self.once])
        ledger = self.ledger

        async def charge(body: Body, session: Annotated[AsyncSession, Context(SESSION)]) -> None:
            self.calls.append(body)
            if self.before is not None:
                await self.before(body)
            await session.execute(
                text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', :n, :r)"),
                {"n": body["amount"], "r": body["ref"]},
            )

        default = {"stream": StreamSub(self.stream, group=self.group, consumer="c1")}
        for source in sources or [default]:
            router.subscriber(**source)(charge)
        broker.include_router(router)
        return broker

    async def pending(self) -> int:
        client = redis.asyncio.Redis.from_url(self.url)
        try:
            summary = await client.xpending(self.stream, self.group)
            return int(summary["pending"])
        finally:
            await client.aclose()


@pytest.fixture
async def setup(redis_url: str, pg: Database, engine: AsyncEngine) -> AsyncIterator[Setup]:
    made = Setup(redis_url, pg, engine)
    yield made
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        await client.delete(made.stream)
    finally:
        await client.aclose()


async def test_same_event_id_twice_is_applied_once(setup: Setup) -> None:
    async with setup.broker() as broker:
        await setup.once.check(broker)
        await broker.start()
        for _ in range(2):
            body = {"amount": 5, "ref": "r-1"}
            await broker.publish(body, stream=setup.stream, headers={"event_id": "e-1"})
        await until(lambda: len(setup.seen.results) == 2, "both entries decided")
        await eventually(setup.pending, 0, "both entries acked")
    assert setup.seen.outcomes() == [Outcome.PROCESSED, Outcome.DUPLICATE]
    assert rows(setup.pg, setup.ledger) == [("r-1", 5)]
    assert records(setup.pg) == [("e-1", "processed")]


async def test_entry_without_id_header_is_keyed_by_its_entry_id(setup: Setup) -> None:
    """Added by redis-py itself: no FastStream envelope, no header; FastStream's id for it
    would be a fresh uuid."""
    async with setup.broker() as broker:
        await broker.start()
        client = redis.asyncio.Redis.from_url(setup.url)
        try:
            body = json.dumps({"amount": 2, "ref": "r-2"})
            entry = await client.xadd(setup.stream, {"data": body})
        finally:
            await client.aclose()
        await until(lambda: len(setup.seen.results) == 1, "decided")
    assert records(setup.pg) == [(f"{setup.stream}:{entry.decode()}", "processed")]
    assert rows(setup.pg, setup.ledger) == [("r-2", 2)]


async def test_transient_failure_stays_pending_and_is_applied_once_when_claimed(
    setup: Setup,
) -> None:
    """RETRY leaves the entry pending (a Redis stream has no nack); a claim brings it back."""

    async def busy_once(body: Body) -> None:
        if len(setup.calls) == 1:
            raise RetryLater("the bank is busy")

    setup.before = busy_once
    reader = StreamSub(setup.stream, group=setup.group, consumer="reader")
    # FastStream's recovery: a subscriber that only claims entries pending 200 ms or more.
    claimer = StreamSub(setup.stream, group=setup.group, consumer="claimer", min_idle_time=200)
    async with setup.broker({"stream": reader}, {"stream": claimer}) as broker:
        await broker.start()
        await broker.publish({"amount": 7, "ref": "r-3"}, stream=setup.stream,
                             headers={"event_id": "e-3"})  # fmt: skip
        await until(lambda: Outcome.PROCESSED in setup.seen.outcomes(), "processed")
        await eventually(setup.pending, 0, "acked")
    assert setup.seen.outcomes() == [Outcome.RETRY, Outcome.PROCESSED]
    assert rows(setup.pg, setup.ledger) == [("r-3", 7)]


async def test_permanent_failure_is_recorded_failed_and_acked(setup: Setup) -> None:
    async def declined(body: Body) -> None:
        raise PermanentError("card declined")

    setup.before = declined
    async with setup.broker() as broker:
        await broker.start()
        await broker.publish({"amount": 9, "ref": "r-4"}, stream=setup.stream,
                             headers={"event_id": "e-4"})  # fmt: skip
        await until(lambda: len(setup.seen.results) == 1, "decided")
        await eventually(setup.pending, 0, "acked, not left pending")
    assert setup.seen.outcomes() == [Outcome.FAILED]
    assert records(setup.pg) == [("e-4", "failed")]
    assert [r.message.id for r in setup.letters] == ["e-4"]


@pytest.mark.parametrize("kind", ["list", "stream without a group"])
async def test_sources_without_acknowledgement_are_refused(setup: Setup, kind: str) -> None:
    """A list, a channel or a stream without a group: FastStream says MANUAL, a message read
    is gone whatever happens next."""
    source = {"list": ListSub(setup.stream)} if kind == "list" else {"stream": setup.stream}
    with pytest.raises(ConfigurationError) as refused:
        await setup.once.check(setup.broker(source))
    assert "StreamSub(stream, group=...)" in str(refused.value)
