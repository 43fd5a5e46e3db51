"""consumerdedup.faststream on a real NATS JetStream and PostgreSQL, through FastStream's
NatsBroker: a message's identity is its Nats-Msg-Id or event_id header, never the uuid
FastStream makes up for a message without a ``message_id`` header."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

import nats
import pytest
from faststream import AckPolicy, Context
from faststream.nats import JStream, NatsBroker, NatsRouter
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from consumerdedup import ConfigurationError, Outcome, PermanentError, Result, RetryLater
from consumerdedup.faststream import NATS_ID_HEADER, SESSION, DedupMiddleware
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

NATS_URL = "nats://127.0.0.1:4222"
Body = dict[str, Any]


@pytest.fixture
def nats_url() -> str:
    if not services.answers("127.0.0.1", 4222):
        services.unavailable("NATS (JetStream) at 127.0.0.1:4222 does not answer")
    return NATS_URL


@pytest.fixture
async def engine(pg: Database) -> AsyncIterator[AsyncEngine]:
    engine = pg.async_engine()
    yield engine
    await engine.dispose()


class Setup:
    """A NatsBroker with one deduplicated JetStream subscriber (on a router) writing the
    ledger; a stream, subject and durable consumer of its own."""

    def __init__(self, url: str, pg: Database, engine: AsyncEngine) -> None:
        unique = uuid.uuid4().hex[:10]
        self.url, self.pg = url, pg
        self.stream, self.subject, self.durable = f"FS{unique}", f"fs.{unique}", f"d{unique}"
        self.ledger = pg.create_ledger()
        self.seen = Seen()
        self.letters: list[Result] = []
        self.calls: list[Body] = []
        self.before: Callable[[Body], Awaitable[None]] | None = None
        dedup = deduplicator(pg, engine, self.seen, dead_letter=self.letters.append)
        self.once = DedupMiddleware(dedup)

    def broker(self, **subscriber: Any) -> NatsBroker:
        broker = NatsBroker(self.url, logger=None)
        router = NatsRouter(middlewares=[self.once])
        ledger = self.ledger
        stream = JStream(self.stream, subjects=[self.subject])

        subscriber.setdefault("pull_sub", True)  # FastStream recommends pull for a durable

        @router.subscriber(self.subject, stream=stream, durable=self.durable, **subscriber)
        async def charge(body: Body, session: Annotated[AsyncSession, Context(SESSION)]) -> None:
            self.calls.append(body)
            if self.before is not None:
                await self.before(body)
            await session.execute(
                text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', :n, :r)"),
                {"n": body["amount"], "r": body["ref"]},
            )

        broker.include_router(router)
        return broker

    async def send(self, body: Body, headers: dict[str, str] | None) -> None:
        """Published with nats-py into the stream (after the broker declared it)."""
        client = await nats.connect(self.url)
        try:
            await client.jetstream().publish(
                self.subject, json.dumps(body).encode(), headers=headers
            )
        finally:
            await client.close()

    async def pending(self) -> tuple[int, int]:
        """The durable consumer's (undelivered, delivered but not acked) counts."""
        client = await nats.connect(self.url)
        try:
            info = await client.jetstream().consumer_info(self.stream, self.durable)
            return info.num_pending or 0, info.num_ack_pending or 0
        finally:
            await client.close()


@pytest.fixture
async def setup(nats_url: str, pg: Database, engine: AsyncEngine) -> AsyncIterator[Setup]:
    made = Setup(nats_url, pg, engine)
    yield made
    client = await nats.connect(nats_url)
    try:
        await client.jetstream().delete_stream(made.stream)
    except nats.js.errors.NotFoundError:
        pass  # a test that never started the broker declared no stream
    finally:
        await client.close()


async def test_same_event_id_twice_is_applied_once(setup: Setup) -> None:
    """JetStream drops a second publish with the same Nats-Msg-Id itself; the event_id
    header is the one it lets through twice."""
    async with setup.broker() as broker:
        await setup.once.check(broker)
        await broker.start()
        for _ in range(2):
            await setup.send({"amount": 5, "ref": "r-1"}, {"event_id": "e-1"})
        await until(lambda: len(setup.seen.results) == 2, "both messages decided")
    assert setup.seen.outcomes() == [Outcome.PROCESSED, Outcome.DUPLICATE]
    assert rows(setup.pg, setup.ledger) == [("r-1", 5)]
    assert records(setup.pg) == [("e-1", "processed")]


async def test_nats_msg_id_is_the_identity(setup: Setup) -> None:
    async with setup.broker() as broker:
        await broker.start()
        await setup.send({"amount": 6, "ref": "r-2"}, {NATS_ID_HEADER: "n-2"})
        await until(lambda: len(setup.seen.results) == 1, "decided")
    assert records(setup.pg) == [("n-2", "processed")]


async def test_transient_failure_is_redelivered_and_applied_once(setup: Setup) -> None:
    async def busy_once(body: Body) -> None:
        if len(setup.calls) == 1:
            raise RetryLater("the bank is busy")

    setup.before = busy_once
    async with setup.broker() as broker:
        await broker.start()
        await setup.send({"amount": 7, "ref": "r-3"}, {"event_id": "e-3"})
        await until(lambda: Outcome.PROCESSED in setup.seen.outcomes(), "processed")
    assert setup.seen.outcomes() == [Outcome.RETRY, Outcome.PROCESSED]
    assert rows(setup.pg, setup.ledger) == [("r-3", 7)]
    assert records(setup.pg) == [("e-3", "processed")]


async def test_permanent_failure_is_recorded_failed_and_terminated(setup: Setup) -> None:
    """REJECT_ON_ERROR (NATS's default) terminates the message: never delivered again."""

    async def declined(body: Body) -> None:
        raise PermanentError("card declined")

    setup.before = declined
    async with setup.broker() as broker:
        await broker.start()
        await setup.send({"amount": 9, "ref": "r-4"}, {"event_id": "e-4"})
        await until(lambda: len(setup.seen.results) == 1, "decided")
        await eventually(setup.pending, (0, 0), "the message terminated, nothing pending")
    assert setup.seen.outcomes() == [Outcome.FAILED]
    assert records(setup.pg) == [("e-4", "failed")]
    assert [r.message.id for r in setup.letters] == ["e-4"]
    assert len(setup.calls) == 1


async def test_message_without_id_is_refused_not_given_fast_streams_uuid(setup: Setup) -> None:
    async with setup.broker() as broker:
        await broker.start()
        await setup.send({"amount": 1, "ref": "r-6"}, None)
        await until(lambda: len(setup.seen.results) == 1, "decided")
    [result] = setup.seen.results
    assert result.outcome is Outcome.FAILED
    assert "no message id" in (result.reason or "")
    assert setup.calls == []
    assert records(setup.pg) == []


@pytest.mark.parametrize("pull", [True, False])
@pytest.mark.parametrize("policy", [AckPolicy.ACK_FIRST, AckPolicy.MANUAL])
async def test_refused_ack_policies_at_start(setup: Setup, policy: AckPolicy, pull: bool) -> None:
    with pytest.raises(ConfigurationError) as refused:
        await setup.once.check(setup.broker(ack_policy=policy, pull_sub=pull))
    # On a JetStream push subscriber FastStream turns ACK_FIRST into MANUAL (its client
    # acks on receipt) and reports MANUAL: the refusal names both.
    assert policy.name in str(refused.value)
