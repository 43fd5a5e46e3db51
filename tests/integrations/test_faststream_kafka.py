"""consumerdedup.faststream on the Kafka-protocol broker (Tansu) and PostgreSQL, through
FastStream's own KafkaBroker: a record's identity is its event_id header or its
coordinates, never FastStream's ``offset-timestamp``."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

import pytest
from faststream import AckPolicy, Context
from faststream.kafka import KafkaBroker, KafkaRouter
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from consumerdedup import ConfigurationError, Outcome, PermanentError, Result, RetryLater
from consumerdedup.faststream import SESSION, DedupMiddleware
from tests.conftest import Database
from tests.integrations.faststream_support import Seen, deduplicator, records, rows, until
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)

Body = dict[str, Any]


@pytest.fixture
async def engine(pg: Database) -> AsyncIterator[AsyncEngine]:
    engine = pg.async_engine()
    yield engine
    await engine.dispose()


class Setup:
    """A KafkaBroker with one deduplicated subscriber (on a router) writing the ledger."""

    def __init__(self, kafka: KafkaService, pg: Database, engine: AsyncEngine, topic: str):
        self.kafka, self.pg, self.topic = kafka, pg, topic
        self.ledger = pg.create_ledger()
        self.seen = Seen()
        self.letters: list[Result] = []
        self.calls: list[Body] = []
        self.before: Callable[[Body], Awaitable[None]] | None = None
        dedup = deduplicator(pg, engine, self.seen, dead_letter=self.letters.append)
        self.once = DedupMiddleware(dedup)

    def broker(self, group: str, **subscriber: Any) -> KafkaBroker:
        broker = KafkaBroker(self.kafka.bootstrap, logger=None)
        router = KafkaRouter(middlewares=[self.once])
        subscriber.setdefault("ack_policy", AckPolicy.ACK)  # Kafka: REJECT_ON_ERROR is the same
        options = {**self.kafka.group_options, **subscriber}
        ledger = self.ledger

        @router.subscriber(self.topic, group_id=group, auto_offset_reset="earliest", **options)
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


@pytest.fixture
async def setup(kafka: KafkaService, topics: Topics, pg: Database, engine: AsyncEngine) -> Setup:
    return Setup(kafka, pg, engine, await topics.create("fs"))


def _group() -> str:
    return f"fs-{uuid.uuid4().hex[:10]}"


async def test_same_event_id_twice_is_applied_once(setup: Setup, topics: Topics) -> None:
    await topics.produce(setup.topic, b'{"amount": 5, "ref": "r-1"}', event_id="e-1")
    await topics.produce(setup.topic, b'{"amount": 5, "ref": "r-1"}', event_id="e-1")
    async with setup.broker(_group()) as broker:
        await setup.once.check(broker)
        await broker.start()
        await until(lambda: len(setup.seen.results) == 2, "both records decided")
    assert setup.seen.outcomes() == [Outcome.PROCESSED, Outcome.DUPLICATE]
    assert rows(setup.pg, setup.ledger) == [("r-1", 5)]
    assert records(setup.pg) == [("e-1", "processed")]


async def test_record_without_id_header_is_keyed_by_its_coordinates(
    setup: Setup, topics: Topics
) -> None:
    """Read again by a second group (a redelivery: same topic, partition, offset): DUPLICATE.
    FastStream's own id (offset-timestamp) is never the key."""
    await topics.produce(setup.topic, b'{"amount": 2, "ref": "r-2"}', partition=0)
    for done in (1, 2):
        async with setup.broker(_group()) as broker:
            await broker.start()
            await until(lambda n=done: len(setup.seen.results) == n, "the record decided")
    assert setup.seen.outcomes() == [Outcome.PROCESSED, Outcome.DUPLICATE]
    assert rows(setup.pg, setup.ledger) == [("r-2", 2)]
    assert records(setup.pg) == [(f"{setup.topic}:0:0", "processed")]


async def test_transient_failure_is_redelivered_and_applied_once(
    setup: Setup, topics: Topics
) -> None:
    async def busy_once(body: Body) -> None:
        if len(setup.calls) == 1:
            raise RetryLater("the bank is busy")

    setup.before = busy_once
    await topics.produce(setup.topic, b'{"amount": 7, "ref": "r-3"}', event_id="e-3")
    group = _group()
    async with setup.broker(group) as broker:
        await broker.start()
        await until(lambda: Outcome.PROCESSED in setup.seen.outcomes(), "processed")
    assert setup.seen.outcomes() == [Outcome.RETRY, Outcome.PROCESSED]
    assert rows(setup.pg, setup.ledger) == [("r-3", 7)]
    assert records(setup.pg) == [("e-3", "processed")]
    assert await topics.committed(group, setup.topic) == {0: 1}


async def test_permanent_failure_is_recorded_failed_and_passed(
    setup: Setup, topics: Topics
) -> None:
    """Kafka's reject is a commit: the record is recorded FAILED, given to the dead_letter
    callback, and the partition moves on to the next record."""

    async def declined(body: Body) -> None:
        if body["ref"] == "r-4":
            raise PermanentError("card declined")

    setup.before = declined
    await topics.produce(setup.topic, b'{"amount": 9, "ref": "r-4"}', event_id="e-4")
    await topics.produce(setup.topic, b'{"amount": 1, "ref": "r-5"}', event_id="e-5")
    group = _group()
    async with setup.broker(group) as broker:
        await broker.start()
        await until(lambda: len(setup.seen.results) == 2, "both decided")
    assert setup.seen.outcomes() == [Outcome.FAILED, Outcome.PROCESSED]
    assert records(setup.pg) == [("e-4", "failed"), ("e-5", "processed")]
    assert rows(setup.pg, setup.ledger) == [("r-5", 1)]
    assert [r.message.id for r in setup.letters] == ["e-4"]
    assert await topics.committed(group, setup.topic) == {0: 2}


@pytest.mark.parametrize("policy", [None, AckPolicy.ACK_FIRST, AckPolicy.MANUAL])
async def test_refused_ack_policies_at_start(setup: Setup, policy: AckPolicy | None) -> None:
    """None: Kafka's default, ACK_FIRST (auto-commit)."""
    if policy is None:
        broker = _default_policy_broker(setup)
    else:
        broker = setup.broker(_group(), ack_policy=policy)
    with pytest.raises(ConfigurationError) as refused:
        await setup.once.check(broker)
    assert (policy or AckPolicy.ACK_FIRST).name in str(refused.value)
    assert "ack_policy=AckPolicy.REJECT_ON_ERROR" in str(refused.value)


def _default_policy_broker(setup: Setup) -> KafkaBroker:
    broker = KafkaBroker(setup.kafka.bootstrap, logger=None)
    router = KafkaRouter(middlewares=[setup.once])

    @router.subscriber(setup.topic, group_id=_group())
    async def charge(body: Body) -> None: ...

    broker.include_router(router)
    return broker


async def test_failed_record_dead_lettered_then_replayed_by_the_cli(
    kafka: KafkaService, topics: Topics, pg: Database, engine: AsyncEngine
) -> None:
    """``dead_letters=broker``: a FAILED record (no id header: keyed by its coordinates) is
    produced to TOPIC.dlq with the runners' headers before its offset commits; after the fix
    ``consumerdedup failed replay --kafka --topic`` forgets the record and re-produces it,
    its id carried in event_id, and the running subscriber applies it once."""
    topic = await topics.create("fs-replay")
    seen = Seen()
    broker = KafkaBroker(kafka.bootstrap, logger=None)
    once = DedupMiddleware(deduplicator(pg, engine, seen), dead_letters=broker)
    router = KafkaRouter(middlewares=[once])
    ledger, fixed = pg.create_ledger(), False
    options = {**kafka.group_options, "ack_policy": AckPolicy.ACK}

    @router.subscriber(topic, group_id=_group(), auto_offset_reset="earliest", **options)
    async def charge(body: Body, session: Annotated[AsyncSession, Context(SESSION)]) -> None:
        if not fixed:
            raise PermanentError("card declined")
        await session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', :n, :r)"),
            {"n": body["amount"], "r": body["ref"]},
        )

    broker.include_router(router)
    await topics.produce(topic, b'{"amount": 3, "ref": "r-20"}', partition=0)
    key = f"{topic}:0:0"
    command = [
        sys.executable, "-m", "consumerdedup", "failed", "replay", "--kafka", kafka.bootstrap,
        "--topic", topic, "--db", pg.url, "--processed-events-table",
        pg.name("processed_events"), "--yes",
    ]  # fmt: skip
    async with broker:
        await broker.start()
        await until(lambda: records(pg) == [(key, "failed")], "recorded FAILED")
        assert await topics.ends(topic + ".dlq") == {0: 1}  # its dead letter
        fixed = True
        done = await asyncio.to_thread(
            subprocess.run, command, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stdout + done.stderr
        await until(lambda: records(pg) == [(key, "processed")], "replayed, processed")
    assert rows(pg, ledger) == [("r-20", 3)]
    assert seen.outcomes() == [Outcome.FAILED, Outcome.PROCESSED]


def test_dead_letters_needs_a_replayable_broker(pg: Database, engine: AsyncEngine) -> None:
    from faststream.nats import NatsBroker

    with pytest.raises(ConfigurationError, match="KafkaBroker or RabbitBroker"):
        DedupMiddleware(deduplicator(pg, engine, Seen()), dead_letters=NatsBroker())
