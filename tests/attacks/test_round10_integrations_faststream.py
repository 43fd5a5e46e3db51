"""Round 10 attacks on consumerdedup.faststream.DedupMiddleware (docs/faststream.md)
through FastStream's own RabbitBroker against the real RabbitMQ and PostgreSQL.

Hole found here: FastStream's own way for a handler to decide its acknowledgement
(``raise NackMessage()`` / ``AckMessage()`` / ``RejectMessage()``, faststream.exceptions)
was taken for a handler error: a NackMessage (deliver it again) was recorded FAILED and
dead-lettered, an AckMessage (done: ack it) had its writes rolled back and was FAILED too.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Annotated, Any

import aio_pika
import pytest
from faststream import Context
from faststream.exceptions import AckMessage, NackMessage, RejectMessage
from faststream.rabbit import RabbitBroker, RabbitQueue, RabbitRouter
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from consumerdedup import Outcome, RetryLater, RetryPolicy
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
from tests.support.rabbitmq_service import amqp_url_fixture  # noqa: F401

Body = dict[str, Any]


@pytest.fixture
async def engine(pg: Database) -> AsyncIterator[AsyncEngine]:
    engine = pg.async_engine()
    yield engine
    await engine.dispose()


class Rabbit:
    """One deduplicated subscriber on a queue of its own with a dead-letter queue."""

    def __init__(self, url: str, pg: Database, engine: AsyncEngine) -> None:
        self.url, self.pg, self.engine = url, pg, engine
        self.queue = f"r10-fs-{uuid.uuid4().hex[:12]}"
        self.dead = f"{self.queue}-dead"
        self.ledger = pg.create_ledger()
        self.seen = Seen()
        self.once = DedupMiddleware(deduplicator(pg, engine, self.seen))
        self.calls = 0

    def retried(self, attempts: int) -> None:
        """The deduplicator tries a failing handler ``attempts`` times in process."""
        policy = RetryPolicy(attempts=attempts, initial_delay=timedelta(0), max_delay=timedelta(0))
        self.once = DedupMiddleware(deduplicator(self.pg, self.engine, self.seen, retry=policy))

    def broker(self, raises: list[BaseException], settles: list[str] = []) -> RabbitBroker:  # noqa: B006
        """Each call writes, then settles its message itself with the next of ``settles``
        (``await message.ack()``, ``nack()``, ``reject()``), then raises the next of
        ``raises`` (none left: returns)."""
        broker = RabbitBroker(self.url, logger=None)
        router = RabbitRouter(middlewares=[self.once])
        queue = RabbitQueue(
            self.queue,
            auto_delete=True,
            arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": self.dead},
        )
        ledger = self.ledger

        @router.subscriber(queue)
        async def charge(
            body: Body,
            session: Annotated[AsyncSession, Context(SESSION)],
            message: Annotated[Any, Context("message")],
        ) -> None:
            self.calls += 1
            await session.execute(
                text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', :n, :r)"),
                {"n": body["amount"], "r": body["ref"]},
            )
            if settles:
                await getattr(message, settles.pop(0))()
            if raises:
                raise raises.pop(0)

        broker.include_router(router)
        return broker

    async def dead_letters(self, expected: int = 0) -> list[bytes]:
        """The dead-letter queue's messages (awaiting ``expected`` of them), taken off it."""
        if expected:
            await eventually(self.dead_count, expected, "the dead letter")
        connection = await aio_pika.connect(self.url)
        async with connection:
            channel = await connection.channel()
            queue = await channel.declare_queue(self.dead, durable=True)
            found = []
            while (message := await queue.get(fail=False, no_ack=True)) is not None:
                found.append(message.body)
            await queue.delete(if_unused=False, if_empty=False)
            return found

    async def queued(self) -> int:
        """Messages in the queue, those delivered and not yet settled included."""
        connection = await aio_pika.connect(self.url)
        async with connection:
            channel = await connection.channel()
            queue = await channel.declare_queue(self.queue, passive=True)
            ready = int(queue.declaration_result.message_count or 0)
        return ready

    async def dead_count(self) -> int:
        connection = await aio_pika.connect(self.url)
        async with connection:
            channel = await connection.channel()
            queue = await channel.declare_queue(self.dead, durable=True)
            return int(queue.declaration_result.message_count or 0)


@pytest.fixture
async def rabbit(amqp_url: str, pg: Database, engine: AsyncEngine) -> AsyncIterator[Rabbit]:
    rabbit = Rabbit(amqp_url, pg, engine)
    await rabbit.dead_count()  # declared before anything is rejected to it
    yield rabbit
    await rabbit.dead_letters()  # and deleted


async def test_a_handler_raising_nackmessage_is_delivered_again_not_failed(
    rabbit: Rabbit, pg: Database
) -> None:
    broker = rabbit.broker([NackMessage()])
    async with broker:
        await broker.start()
        await broker.publish({"amount": 5, "ref": "n-1"}, rabbit.queue, message_id="n-1")
        await until(lambda: Outcome.PROCESSED in rabbit.seen.outcomes(), "processed")
        await until(lambda: rabbit.calls == 2, "delivered again")
    assert rabbit.seen.outcomes() == [Outcome.RETRY, Outcome.PROCESSED]
    assert rows(pg, rabbit.ledger) == [("n-1", 5)]  # the nacked call's write rolled back
    assert records(pg) == [("n-1", "processed")]
    assert await rabbit.dead_letters() == []


async def test_a_handler_raising_ackmessage_commits_its_writes_once_and_is_acked(
    rabbit: Rabbit, pg: Database
) -> None:
    broker = rabbit.broker([AckMessage(), AckMessage()])
    async with broker:
        await broker.start()
        for _ in range(2):  # the same message twice: the second a DUPLICATE
            await broker.publish({"amount": 6, "ref": "a-1"}, rabbit.queue, message_id="a-1")
        await until(lambda: len(rabbit.seen.results) == 2, "both decided")
    assert rabbit.seen.outcomes() == [Outcome.PROCESSED, Outcome.DUPLICATE]
    assert rows(pg, rabbit.ledger) == [("a-1", 6)]
    assert records(pg) == [("a-1", "processed")]
    assert await rabbit.dead_letters() == []


async def test_a_handler_raising_rejectmessage_is_failed_at_once_and_dead_lettered(
    rabbit: Rabbit, pg: Database
) -> None:
    rabbit.retried(3)  # a handler error would be tried 3 times; a reject is final at once
    broker = rabbit.broker([RejectMessage()])
    async with broker:
        await broker.start()
        await broker.publish({"amount": 7, "ref": "r-1"}, rabbit.queue, message_id="r-1")
        await until(lambda: len(rabbit.seen.results) == 1, "decided")
    assert rabbit.seen.outcomes() == [Outcome.FAILED]
    assert rabbit.calls == 1
    assert rows(pg, rabbit.ledger) == []
    assert records(pg) == [("r-1", "failed")]
    dead = await rabbit.dead_letters(expected=1)
    assert [json.loads(b)["ref"] for b in dead] == ["r-1"]


async def test_a_handler_acking_its_message_itself_then_failing_is_still_delivered_again(
    rabbit: Rabbit, pg: Database
) -> None:
    """``await message.ack()`` in the handler, then a transient error: the ack must wait for
    the COMMIT (there was none: RETRY, delivered again), or the message is gone with nothing
    recorded and nothing applied."""
    broker = rabbit.broker([RetryLater("the bank is busy")], settles=["ack"])
    async with broker:
        await broker.start()
        await broker.publish({"amount": 8, "ref": "m-1"}, rabbit.queue, message_id="m-1")
        await until(lambda: Outcome.PROCESSED in rabbit.seen.outcomes(), "processed")
    assert rabbit.seen.outcomes() == [Outcome.RETRY, Outcome.PROCESSED]
    assert rows(pg, rabbit.ledger) == [("m-1", 8)]
    assert records(pg) == [("m-1", "processed")]


@pytest.mark.parametrize(
    ("settle", "outcome", "ledger", "record"),
    [
        ("ack", Outcome.PROCESSED, [("s-1", 9)], [("s-1", "processed")]),
        ("reject", Outcome.FAILED, [], [("s-1", "failed")]),
    ],
)
async def test_a_handler_settling_its_message_itself_is_settled_after_the_commit(
    rabbit: Rabbit,
    pg: Database,
    settle: str,
    outcome: Outcome,
    ledger: list[tuple[str, int]],
    record: list[tuple[str, str]],
) -> None:
    broker = rabbit.broker([], settles=[settle])
    async with broker:
        await broker.start()
        await broker.publish({"amount": 9, "ref": "s-1"}, rabbit.queue, message_id="s-1")
        await until(lambda: len(rabbit.seen.results) == 1, "decided")
        await eventually(rabbit.queued, 0, "the message settled")
    assert rabbit.seen.outcomes() == [outcome]
    assert rows(pg, rabbit.ledger) == ledger
    assert records(pg) == record


async def test_one_id_from_two_producers_with_other_bodies_and_replies_on_duplicates(
    rabbit: Rabbit, pg: Database
) -> None:
    """The same message_id from two producers with different payloads: PayloadMismatch
    (FAILED, dead-lettered), never applied; a plain redelivery of the first is a DUPLICATE
    that publishes no reply (the first run's reply is published once)."""
    replies = f"{rabbit.queue}-replies"
    connection = await aio_pika.connect(rabbit.url)
    async with connection:
        channel = await connection.channel()
        reply_queue = await channel.declare_queue(replies, auto_delete=False)
        broker = rabbit.broker([])
        try:
            async with broker:
                await broker.start()
                first = {"amount": 1, "ref": "p-1"}
                await broker.publish(first, rabbit.queue, message_id="p-1", reply_to=replies)
                await until(lambda: len(rabbit.seen.results) == 1, "the first decided")
                other = {"amount": 1000, "ref": "p-1"}  # another producer, same id
                await broker.publish(other, rabbit.queue, message_id="p-1", reply_to=replies)
                await broker.publish(first, rabbit.queue, message_id="p-1", reply_to=replies)
                await until(lambda: len(rabbit.seen.results) == 3, "all three decided")
                await eventually(rabbit.queued, 0, "every delivery settled")
            assert rabbit.seen.outcomes() == [
                Outcome.PROCESSED,
                Outcome.FAILED,
                Outcome.DUPLICATE,
            ]
            assert "PayloadMismatch" in str(rabbit.seen.results[1].reason)
            assert rows(pg, rabbit.ledger) == [("p-1", 1)]
            assert records(pg) == [("p-1", "processed")]
            dead = await rabbit.dead_letters(expected=1)
            assert [json.loads(b)["amount"] for b in dead] == [1000]
            await eventually(
                lambda: _count(channel, replies), 1, "one reply (the first run's), no more"
            )
        finally:
            await reply_queue.delete(if_unused=False, if_empty=False)


async def _count(channel: Any, name: str) -> int:
    queue = await channel.declare_queue(name, passive=True)
    return int(queue.declaration_result.message_count or 0)
