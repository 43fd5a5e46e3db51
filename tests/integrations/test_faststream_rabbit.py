"""consumerdedup.faststream on a real RabbitMQ and PostgreSQL, through FastStream's own
RabbitBroker: what the ledger holds, what processed_events holds, what the queues hold."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

import aio_pika
import pika
import pytest
from faststream import AckPolicy, Context
from faststream.rabbit import RabbitBroker, RabbitQueue, RabbitRouter
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from consumerdedup import (
    AsyncDeduplicator,
    ConfigurationError,
    Outbox,
    Outcome,
    PermanentError,
    RetryLater,
    Tables,
)
from consumerdedup.faststream import SESSION, DedupMiddleware
from tests.conftest import Database
from tests.integrations.faststream_support import Seen, deduplicator, records, rows, until
from tests.support.rabbitmq_service import amqp_url_fixture  # noqa: F401

Body = dict[str, Any]


@pytest.fixture
async def engine(pg: Database) -> AsyncIterator[AsyncEngine]:
    engine = pg.async_engine()
    yield engine
    await engine.dispose()


@pytest.fixture
def names() -> tuple[str, str]:
    """A queue and its dead-letter queue, unique to the test."""
    queue = f"fs-{uuid.uuid4().hex[:12]}"
    return queue, f"{queue}-dead"


class Setup:
    """A RabbitBroker with one deduplicated subscriber (on a router) writing the ledger."""

    def __init__(self, url: str, pg: Database, engine: AsyncEngine, names: tuple[str, str]):
        self.url, self.pg, self.queue, self.dead = url, pg, *names
        self.ledger = pg.create_ledger()
        self.seen = Seen()
        self.calls: list[Body] = []
        self.before: Callable[[Body], Awaitable[None]] | None = None
        self.once = DedupMiddleware(deduplicator(pg, engine, self.seen), key=self.key)
        self.keyed = False
        self.auto_delete = True

    def key(self, message: Any) -> str | None:
        return json.loads(message.body).get("ref") if self.keyed else None

    def broker(self, **subscriber: Any) -> RabbitBroker:
        broker = RabbitBroker(self.url, logger=None)
        router = RabbitRouter(middlewares=[self.once])
        queue = RabbitQueue(
            self.queue,
            auto_delete=self.auto_delete,
            arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": self.dead},
        )
        ledger = self.ledger

        @router.subscriber(queue, **subscriber)
        async def charge(body: Body, session: Annotated[AsyncSession, Context(SESSION)]) -> str:
            self.calls.append(body)
            if self.before is not None:
                await self.before(body)
            await session.execute(
                text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', :n, :r)"),
                {"n": body["amount"], "r": body["ref"]},
            )
            return "charged"

        broker.include_router(router)
        return broker

    async def send(self, body: Body, message_id: str | None, reply_to: str | None = None) -> None:
        """Published with pika: a message_id only when given (aio-pika's transport, aiormq,
        would make one up for a message published without)."""
        properties = pika.BasicProperties(
            message_id=message_id, reply_to=reply_to, content_type="application/json"
        )

        def publish() -> None:
            connection = pika.BlockingConnection(pika.URLParameters(self.url))
            try:
                channel = connection.channel()
                channel.basic_publish("", self.queue, json.dumps(body).encode(), properties)
            finally:
                connection.close()

        await asyncio.to_thread(publish)

    async def dead_letters(self) -> list[bytes]:
        connection = await aio_pika.connect(self.url)
        async with connection:
            channel = await connection.channel()
            queue = await channel.declare_queue(self.dead, durable=True)
            found = []
            while (message := await queue.get(fail=False, no_ack=True)) is not None:
                found.append(message.body)
            return found


@pytest.fixture
async def setup(
    amqp_url: str, pg: Database, engine: AsyncEngine, names: tuple[str, str]
) -> AsyncIterator[Setup]:
    made = Setup(amqp_url, pg, engine, names)
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(made.dead, durable=True)  # before any dead letter
    yield made
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        await channel.queue_delete(made.dead)
        await channel.queue_delete(made.queue)


async def test_delivered_twice_is_applied_once(setup: Setup) -> None:
    async with setup.broker() as broker:
        await setup.once.check(broker)
        await broker.start()
        await setup.send({"amount": 5, "ref": "r-1"}, "m-1")
        await setup.send({"amount": 5, "ref": "r-1"}, "m-1")
        await until(lambda: len(setup.seen.results) == 2, "both deliveries decided")
    assert sorted(o.value for o in setup.seen.outcomes()) == ["duplicate", "processed"]
    assert rows(setup.pg, setup.ledger) == [("r-1", 5)]
    assert records(setup.pg) == [("m-1", "processed")]
    assert len(setup.calls) == 1
    assert await setup.dead_letters() == []


async def test_duplicate_publishes_no_reply(setup: Setup, amqp_url: str) -> None:
    """A reply goes to reply_to after PROCESSED; a DUPLICATE acks and publishes nothing."""
    replies = f"{setup.queue}-replies"
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        reply_queue = await channel.declare_queue(replies, auto_delete=False)
        async with setup.broker() as broker:
            await broker.start()
            for _ in range(2):
                await setup.send({"amount": 3, "ref": "r-2"}, "m-2", reply_to=replies)
            await until(lambda: len(setup.seen.results) == 2, "both deliveries decided")
        got = []
        while (message := await reply_queue.get(fail=False, no_ack=True)) is not None:
            got.append(message.body)
        await channel.queue_delete(replies)
    assert sorted(o.value for o in setup.seen.outcomes()) == ["duplicate", "processed"]
    assert got == [b"charged"]


async def test_transient_failure_is_redelivered_and_applied_once(setup: Setup) -> None:
    async def busy_once(body: Body) -> None:
        if len(setup.calls) == 1:
            raise RetryLater("the bank is busy")

    setup.before = busy_once
    async with setup.broker() as broker:
        await broker.start()
        await setup.send({"amount": 7, "ref": "r-3"}, "m-3")
        await until(lambda: Outcome.PROCESSED in setup.seen.outcomes(), "processed")
    assert setup.seen.outcomes() == [Outcome.RETRY, Outcome.PROCESSED]
    assert rows(setup.pg, setup.ledger) == [("r-3", 7)]
    assert records(setup.pg) == [("m-3", "processed")]
    assert await setup.dead_letters() == []


@pytest.mark.parametrize("policy", [AckPolicy.REJECT_ON_ERROR, AckPolicy.NACK_ON_ERROR])
async def test_permanent_failure_is_recorded_failed_and_dead_lettered(
    setup: Setup, policy: AckPolicy
) -> None:
    async def declined(body: Body) -> None:
        raise PermanentError("card declined")

    setup.before = declined
    async with setup.broker(ack_policy=policy) as broker:
        await broker.start()
        await setup.send({"amount": 9, "ref": "r-4"}, "m-4")
        await until(lambda: len(setup.seen.results) == 1, "decided")
        letters = await _letters(setup)
    assert setup.seen.outcomes() == [Outcome.FAILED]
    assert rows(setup.pg, setup.ledger) == []
    assert records(setup.pg) == [("m-4", "failed")]
    assert letters == [b'{"amount": 9, "ref": "r-4"}']
    assert len(setup.calls) == 1


async def test_permanent_failure_under_ack_is_recorded_and_acked(setup: Setup) -> None:
    async def declined(body: Body) -> None:
        raise PermanentError("card declined")

    setup.before = declined
    async with setup.broker(ack_policy=AckPolicy.ACK) as broker:
        await broker.start()
        await setup.send({"amount": 9, "ref": "r-5"}, "m-5")
        await until(lambda: len(setup.seen.results) == 1, "decided")
    assert records(setup.pg) == [("m-5", "failed")]
    assert await setup.dead_letters() == []


async def test_message_without_message_id_is_dead_lettered_not_given_an_id(
    setup: Setup,
) -> None:
    async with setup.broker() as broker:
        await broker.start()
        await setup.send({"amount": 1, "ref": "r-6"}, None)
        await until(lambda: len(setup.seen.results) == 1, "decided")
        result = setup.seen.results[0]
        letters = await _letters(setup)
    assert result.outcome is Outcome.FAILED
    assert "no message id" in (result.reason or "")
    assert setup.calls == []
    assert records(setup.pg) == []  # FastStream's gen_cor_id was not taken as its id
    assert letters == [b'{"amount": 1, "ref": "r-6"}']


async def test_message_without_message_id_takes_the_key_function(setup: Setup) -> None:
    setup.keyed = True
    async with setup.broker() as broker:
        await broker.start()
        await setup.send({"amount": 2, "ref": "r-7"}, None)
        await setup.send({"amount": 2, "ref": "r-7"}, None)
        await until(lambda: len(setup.seen.results) == 2, "both decided")
    assert sorted(o.value for o in setup.seen.outcomes()) == ["duplicate", "processed"]
    assert rows(setup.pg, setup.ledger) == [("r-7", 2)]
    assert records(setup.pg) == [("r-7", "processed")]


@pytest.mark.parametrize("policy", [AckPolicy.ACK_FIRST, AckPolicy.MANUAL])
async def test_refused_ack_policies_at_start(setup: Setup, policy: AckPolicy) -> None:
    broker = setup.broker(ack_policy=policy)
    with pytest.raises(ConfigurationError) as refused:
        await setup.once.check(broker)
    assert policy.name in str(refused.value)
    assert "ack_policy=AckPolicy.REJECT_ON_ERROR" in str(refused.value)


async def test_twins_in_one_process_wait_on_the_claim(setup: Setup) -> None:
    """No prefetch: FastStream runs both deliveries at once; the second waits on the
    first's claim (seen waiting on a lock in PostgreSQL), then answers DUPLICATE."""
    release = asyncio.Event()

    async def hold_first(body: Body) -> None:
        await release.wait()

    setup.before = hold_first
    async with setup.broker() as broker:
        await broker.start()
        await setup.send({"amount": 4, "ref": "r-8"}, "m-8")
        await until(lambda: len(setup.calls) == 1, "the first delivery in its handler")
        await setup.send({"amount": 4, "ref": "r-8"}, "m-8")
        await until(lambda: _lock_waiters(setup.pg) > 0, "the twin waiting on the claim")
        release.set()
        await until(lambda: len(setup.seen.results) == 2, "both decided")
    assert setup.seen.outcomes() == [Outcome.PROCESSED, Outcome.DUPLICATE]
    assert len(setup.calls) == 1
    assert rows(setup.pg, setup.ledger) == [("r-8", 4)]


def _lock_waiters(pg: Database) -> int:
    """Backends of this test's schema waiting on a lock (the twin's claim INSERT)."""
    with pg.engine.connect() as conn:
        found = conn.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query LIKE :schema"
            ),
            {"schema": f"%{pg.schema}.processed_events%"},
        )
        return int(found.scalar() or 0)


async def _letters(setup: Setup) -> list[bytes]:
    """The dead-letter queue's messages, polled until one is there (30 s)."""
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        letters = await setup.dead_letters()
        if letters or asyncio.get_running_loop().time() > deadline:
            return letters
        await asyncio.sleep(0.05)


async def test_only_the_routers_subscribers_are_deduplicated_and_checked(
    setup: Setup, amqp_url: str
) -> None:
    """Opt-in per subscriber: one on the broker itself (ACK_FIRST, not deduplicated) is
    neither refused by check() nor given a session or a record."""
    plain_queue = f"{setup.queue}-plain"
    broker = setup.broker()
    plain: list[Body] = []

    @broker.subscriber(RabbitQueue(plain_queue, auto_delete=True), ack_policy=AckPolicy.ACK_FIRST)
    async def audit(body: Body) -> None:
        plain.append(body)

    async with broker:
        await setup.once.check(broker)
        await broker.start()
        await broker.publish({"amount": 1, "ref": "r-9"}, plain_queue, message_id="m-9")
        await setup.send({"amount": 2, "ref": "r-10"}, "m-10")
        await until(lambda: bool(plain) and len(setup.seen.results) == 1, "both consumed")
    assert records(setup.pg) == [("m-10", "processed")]
    assert plain == [{"amount": 1, "ref": "r-9"}]


async def test_outbox_event_of_the_handler_is_added_once(setup: Setup) -> None:
    """The documented way to publish exactly once: Outbox.add on the handler's session."""
    outbox = Outbox(setup.pg.tables)

    async def announce(body: Body) -> None:
        session = context.get_local(SESSION)
        await outbox.add(session, "charged", json.dumps(body).encode(), key=body["ref"])

    setup.before = announce
    async with setup.broker() as broker:
        context = broker.context
        await broker.start()
        await setup.send({"amount": 8, "ref": "r-11"}, "m-11")
        await setup.send({"amount": 8, "ref": "r-11"}, "m-11")
        await until(lambda: len(setup.seen.results) == 2, "both decided")
    with setup.pg.engine.connect() as conn:
        events = conn.execute(text(f"SELECT key FROM {setup.pg.name('outbox')}")).all()
    assert [tuple(e) for e in events] == [("r-11",)]
    assert rows(setup.pg, setup.ledger) == [("r-11", 8)]


def _waiting(url: str, queue: str) -> int:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        return int(connection.channel().queue_declare(queue, passive=True).method.message_count)
    finally:
        connection.close()


async def _replay(setup: Setup, *extra: str) -> subprocess.CompletedProcess[str]:
    where = extra if "--queue" in extra else ("--dead-letter-queue", setup.dead, *extra)
    command = [
        sys.executable, "-m", "consumerdedup", "failed", "replay", "--rabbitmq", setup.url,
        "--db", setup.pg.url, "--processed-events-table", setup.pg.name("processed_events"),
        "--yes", *where,
    ]  # fmt: skip
    return await asyncio.to_thread(
        subprocess.run, command, capture_output=True, text=True, timeout=60
    )


async def test_failed_message_replayed_from_the_brokers_dead_letter_queue(setup: Setup) -> None:
    """REJECT_ON_ERROR sends a FAILED message through the queue's dead-letter exchange:
    ``failed replay --rabbitmq --dead-letter-queue --consumer`` forgets its record and
    republishes it to the queue RabbitMQ's x-death names; the running subscriber applies
    it once. Without --consumer (the broker's letter names none) it stays, and says why."""
    fixed = False

    async def declined(body: Body) -> None:
        if not fixed:
            raise PermanentError("card declined")

    setup.before = declined
    async with setup.broker() as broker:
        await broker.start()
        await setup.send({"amount": 6, "ref": "r-12"}, "m-12")
        await until(lambda: _waiting(setup.url, setup.dead) == 1, "the dead letter")
        assert records(setup.pg) == [("m-12", "failed")]
        kept = await _replay(setup)
        assert kept.returncode == 1, kept.stdout + kept.stderr
        assert "pass --consumer NAME" in kept.stdout, kept.stdout
        assert records(setup.pg) == [("m-12", "failed")]
        fixed = True
        done = await _replay(setup, "--consumer", "faststream")
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"-> {setup.queue}" in done.stdout, done.stdout
        await until(lambda: records(setup.pg) == [("m-12", "processed")], "replayed")
    assert rows(setup.pg, setup.ledger) == [("r-12", 6)]
    assert setup.seen.outcomes() == [Outcome.FAILED, Outcome.PROCESSED]
    assert _waiting(setup.url, setup.dead) == 0


async def test_refused_policy_halts_at_the_first_delivery_without_check(setup: Setup) -> None:
    """No check() in user code: MANUAL (the handler would ack before the COMMIT) is refused
    on the first delivery; the subscriber stops; the message is neither processed, nor
    recorded, nor dead-lettered: it is back in the queue once the broker closes."""
    setup.auto_delete = False  # the queue must outlive the stopped consumer
    async with setup.broker(ack_policy=AckPolicy.MANUAL) as broker:
        await broker.start()
        [subscriber] = broker.subscribers
        await setup.send({"amount": 1, "ref": "r-13"}, "m-13")
        await until(lambda: not subscriber.running, "the subscriber stopped")
        assert "MANUAL" in str(setup.once.refused)
    assert setup.calls == [] and records(setup.pg) == []
    await until(lambda: _waiting(setup.url, setup.queue) == 1, "the message back in its queue")
    assert _waiting(setup.url, setup.dead) == 0


async def test_setup_fault_under_an_app_exits_it_and_dead_letters_nothing(
    amqp_url: str, pg: Database, engine: AsyncEngine, names: tuple[str, str]
) -> None:
    """REJECT_ON_ERROR, no check(), the dedup tables missing: the first delivery is nacked
    (a reject would dead-letter it), and the FastStream app running the broker exits."""
    from faststream import FastStream

    missing = Tables.define(f"{pg.schema}.no_such_events", f"{pg.schema}.no_such_outbox")
    seen = Seen()
    dedup = AsyncDeduplicator(engine, "faststream", tables=missing, observers=[seen.results.append])
    setup = Setup(amqp_url, pg, engine, names)
    setup.once, setup.auto_delete = DedupMiddleware(dedup), False
    broker = setup.broker()
    app = FastStream(broker)
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    channel = connection.channel()
    try:
        channel.queue_declare(setup.dead, durable=True)
        running = asyncio.create_task(app.run())
        await until(lambda: broker.running, "the broker started")
        await setup.send({"amount": 2, "ref": "r-14"}, "m-14")
        await asyncio.wait_for(running, 30)  # the app exits by itself
        assert isinstance(setup.once.refused, ConfigurationError)
        assert setup.calls == [] and seen.results == []
        await until(lambda: _waiting(amqp_url, setup.queue) == 1, "back in its queue")
        assert _waiting(amqp_url, setup.dead) == 0  # not dead-lettered
    finally:
        channel.queue_delete(setup.queue)
        channel.queue_delete(setup.dead)
        connection.close()


async def test_dead_letters_option_writes_the_runners_dead_letter_for_replay(
    amqp_url: str, pg: Database, engine: AsyncEngine, names: tuple[str, str]
) -> None:
    """``dead_letters=broker`` under ACK: a FAILED message's copy goes to QUEUE.dlq with the
    runners' headers, so ``failed replay --rabbitmq --queue`` needs no --consumer."""
    queue, dlq = names[0], names[0] + ".dlq"
    seen, calls = Seen(), []
    broker = RabbitBroker(amqp_url, logger=None)
    once = DedupMiddleware(deduplicator(pg, engine, seen), dead_letters=broker)
    router = RabbitRouter(middlewares=[once])
    setup = Setup(amqp_url, pg, engine, (queue, dlq))  # its send() and ledger
    ledger, fixed = setup.ledger, False

    @router.subscriber(RabbitQueue(queue, durable=True), ack_policy=AckPolicy.ACK)
    async def charge(body: Body, session: Annotated[AsyncSession, Context(SESSION)]) -> None:
        calls.append(body)
        if not fixed:
            raise PermanentError("card declined")
        await session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', :n, :r)"),
            {"n": body["amount"], "r": body["ref"]},
        )

    broker.include_router(router)
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    channel = connection.channel()
    channel.queue_declare(dlq, durable=True)
    try:
        async with broker:
            await broker.start()
            await setup.send({"amount": 4, "ref": "r-15"}, "m-15")
            await until(lambda: _waiting(amqp_url, dlq) == 1, "the dead letter")
            assert records(pg) == [("m-15", "failed")]
            fixed = True
            done = await _replay(setup, "--queue", queue)
            assert done.returncode == 0, done.stdout + done.stderr
            await until(lambda: records(pg) == [("m-15", "processed")], "replayed")
        assert rows(pg, ledger) == [("r-15", 4)]
        assert seen.outcomes() == [Outcome.FAILED, Outcome.PROCESSED]
        assert _waiting(amqp_url, dlq) == 0
    finally:
        channel.queue_delete(queue)
        channel.queue_delete(dlq)
        connection.close()
