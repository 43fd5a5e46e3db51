"""Round 6 on the RabbitMQ runner (real broker and PostgreSQL).

- The dead-letter queue deleted while the runner runs. Before: with
  ``RabbitConfig(declare=True)`` the topology was declared only at connect, so every FAILED
  delivery after the deletion came back unsent, again and again, until a reconnect (its log
  advising the ``declare=True`` already set). Now the DLQ is declared again at the first
  unroutable dead letter. Without ``declare`` run() stops with DeadLetterMissing naming the
  DLQ and the fix (issue 38, item 5); the delivery stays in the queue, unacked, its FAILED
  record kept.
- The consumed queue deleted (no ``declare``): the TopologyError named the queue but not the
  way out; now it says to declare it or set ``declare=True``.
- Hostile ids (NUL, 256 characters, not UTF-8, empty) in message_id and the id header
  across a bulk handler: held when written (each FAILED alone, the rest applied, all acked).
- SystemExit, KeyboardInterrupt, CancelledError from a bulk handler mid-batch, blocking or
  async: held (raised out of run(), nothing recorded, nothing acked).
"""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta
from typing import Any

import pika
import pytest
from sqlalchemy import text

from consumerdedup import AsyncDeduplicator, Deduplicator, Message, Outcome
from consumerdedup.adapters.rabbitmq import (
    DeadLetterMissing,
    RabbitConfig,
    RabbitConsumerRunner,
    TopologyError,
)
from consumerdedup.headers import REASON_HEADER
from tests.rabbitmq.test_runner import Consumer, body, dead_letters
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401

pytestmark = pytest.mark.postgres


def wait_until(condition: Any, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def letters(rabbit: Broker, queue: str) -> list[tuple[Any, bytes]]:
    """The dead letters of ``queue``; none while its DLQ does not exist."""
    try:
        return dead_letters(rabbit, queue)
    except pika.exceptions.ChannelClosedByBroker:  # 404: not there (yet)
        return []


def recorded(db: Any) -> dict[str, str]:
    with db.engine.connect() as conn:
        sql = f"SELECT message_id, outcome FROM {db.name('processed_events')}"
        return {r[0]: r[1] for r in conn.exec_driver_sql(sql)}


def test_the_dead_letter_queue_deleted_while_running_is_declared_again(
    pg: Any, rabbit: Broker
) -> None:
    queue = rabbit.queue()
    consumer = Consumer(pg, rabbit, queue, declare=True)
    stop = consumer.start()
    try:
        rabbit.publish(queue, body(n=1), "m-1")
        wait_until(lambda: consumer.applied() == ["m-1"], "m-1 applied")
        rabbit.channel.queue_delete(queue + ".dlq")
        rabbit.publish(queue, body(refuse="bad"), "m-2")
        rabbit.publish(queue, body(n=3), "m-3")
        wait_until(lambda: "m-3" in consumer.applied(), "m-3 applied")
        wait_until(lambda: letters(rabbit, queue), "m-2 dead-lettered")
    finally:
        stop()
    assert sorted(consumer.applied()) == ["m-1", "m-3"]
    assert recorded(pg) == {"m-1": "processed", "m-2": "failed", "m-3": "processed"}
    [(properties, _)] = letters(rabbit, queue)
    assert properties.message_id == "m-2"
    assert "bad" in properties.headers[REASON_HEADER]
    assert rabbit.held(queue) == 0


def test_the_dead_letter_queue_deleted_while_running_without_declare_stops_the_runner(
    pg: Any, rabbit: Broker
) -> None:
    """Without ``declare`` a dead letter with nowhere to go is a setup fault (issue 38, item
    5): run() raises DeadLetterMissing naming the DLQ and the fix; m-2 stays in the queue,
    unacked, its FAILED record kept (it used to come back, unsent, forever)."""
    queue = rabbit.queue()
    consumer = Consumer(pg, rabbit, queue)
    raised: list[BaseException] = []

    def run() -> None:
        try:
            consumer.runner.run()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        rabbit.publish(queue, body(n=1), "m-1")
        wait_until(lambda: consumer.applied() == ["m-1"], "m-1 applied")
        rabbit.channel.queue_delete(queue + ".dlq")
        rabbit.publish(queue, body(refuse="bad"), "m-2")
        wait_until(lambda: not thread.is_alive(), "run() to stop on the fault")
    finally:
        consumer.runner.stop()
        thread.join(30)
    [error] = raised
    assert isinstance(error, DeadLetterMissing)
    assert f"declare the dead-letter queue {queue + '.dlq'!r}" in str(error)
    assert "RabbitConfig(declare=True)" in str(error)
    assert recorded(pg) == {"m-1": "processed", "m-2": "failed"}
    assert rabbit.held(queue) == 1, "m-2 was acked without its dead letter"
    [properties, _] = rabbit.peek(queue)[0]
    assert properties.message_id == "m-2"


def test_hostile_ids_across_a_bulk_handler_fail_alone(pg: Any, rabbit: Broker) -> None:
    """message_id properties and id headers no database can hold (NUL, 256 characters, not
    UTF-8, empty) among good ones, in one batch for a bulk handler: each FAILED and
    dead-lettered alone, never handed to the handler; the rest applied once; all acked."""
    queue = rabbit.queue()
    good = ["ok-1", "é" * 255, "ok-2", "from-header"]
    rabbit.publish(queue, body(n=1), "ok-1")
    rabbit.publish(queue, body(n=2), "nul\x00inside")
    rabbit.publish(queue, body(n=3), headers={"event_id": "é" * 255})  # 510 bytes: no shortstr
    rabbit.publish(queue, body(n=4), headers={"event_id": b"\xff\xfenot-utf-8"})
    rabbit.publish(queue, body(n=5), headers={"event_id": "y" * 256})
    rabbit.publish(queue, body(n=6), headers={"event_id": ""})
    rabbit.publish(queue, body(n=7), "ok-2")
    rabbit.publish(queue, body(n=8), headers={"event_id": "from-header"})
    ledger = pg.create_ledger()
    dedup = Deduplicator(pg.engine, consumer="hostile", tables=pg.tables)
    calls: list[list[str]] = []
    insert = text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', 1, :m)")

    @dedup.bulk_handler
    def place(messages: list[Message], session: Any) -> None:
        calls.append([m.id for m in messages])
        session.execute(insert, [{"m": m.id} for m in messages])

    runner = RabbitConsumerRunner(
        place,
        queue,
        url=rabbit.url,
        config=RabbitConfig(idle_timeout=timedelta(milliseconds=300), batch_size=20),
    )
    runner.run(until_idle=True)
    with pg.engine.connect() as conn:
        applied = sorted(r[0] for r in conn.exec_driver_sql(f"SELECT message_id FROM {ledger}"))
    assert applied == sorted(good)
    assert sorted(mid for call in calls for mid in call) == sorted(good), calls
    assert runner.outcomes == {Outcome.PROCESSED: len(good), Outcome.FAILED: 4}
    assert len(letters(rabbit, queue)) == 4
    assert rabbit.held(queue) == 0


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize(
    "error", [SystemExit(3), KeyboardInterrupt(), asyncio.CancelledError()], ids=type
)
def test_a_base_exception_mid_bulk_call_commits_and_acks_nothing(
    pg: Any, rabbit: Broker, error: BaseException, kind: str
) -> None:
    """Raised by a bulk handler after half its writes (blocking, or async on the runner's
    own event loop): it leaves run() as it is, nothing of the batch is recorded or
    applied, every message stays with the broker."""
    queue = rabbit.queue()
    for n in range(6):
        rabbit.publish(queue, body(n=n), f"m-{n}")
    ledger = pg.create_ledger()
    insert = text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', 1, :m)")
    engine = pg.async_engine()

    def half(messages: list[Message]) -> list[dict[str, str]]:
        return [{"m": m.id} for m in messages[: len(messages) // 2 or 1]]

    if kind == "sync":

        @Deduplicator(pg.engine, consumer="base", tables=pg.tables).bulk_handler
        def place(messages: list[Message], session: Any) -> None:
            session.execute(insert, half(messages))
            raise error

        handler: Any = place
    else:

        @AsyncDeduplicator(engine, consumer="base", tables=pg.tables).bulk_handler
        async def place_async(messages: list[Message], session: Any) -> None:
            await session.execute(insert, half(messages))
            raise error

        handler = place_async
    runner = RabbitConsumerRunner(
        handler, queue, url=rabbit.url, config=RabbitConfig(prefetch=6, batch_size=6)
    )
    with pytest.raises(type(error)):
        runner.run()
    asyncio.run(engine.dispose())
    with pg.engine.connect() as conn:
        assert conn.exec_driver_sql(f"SELECT count(*) FROM {ledger}").scalar() == 0
    assert recorded(pg) == {}
    assert rabbit.held(queue) == 6


def test_the_dead_letter_exchange_deleted_while_running_is_declared_again(
    pg: Any, rabbit: Broker
) -> None:
    """The same with a dead-letter exchange: the broker closes the publishing channel (404);
    with ``declare=True`` the exchange (and its binding) is declared again and m-2 goes."""
    queue, exchange = rabbit.name(), rabbit.name("dlx")
    consumer = Consumer(pg, rabbit, queue, declare=True, dead_letter_exchange=exchange)
    stop = consumer.start()
    try:
        wait_until(lambda: letters(rabbit, queue) == [] and _exists(rabbit, queue), "declared")
        rabbit.publish(queue, body(n=1), "m-1")
        wait_until(lambda: consumer.applied() == ["m-1"], "m-1 applied")
        rabbit.channel.exchange_delete(exchange)
        rabbit.publish(queue, body(refuse="bad"), "m-2")
        rabbit.publish(queue, body(n=3), "m-3")
        wait_until(lambda: "m-3" in consumer.applied(), "m-3 applied")
        wait_until(lambda: letters(rabbit, queue), "m-2 dead-lettered")
    finally:
        stop()
    [(properties, _)] = letters(rabbit, queue)
    assert properties.message_id == "m-2"
    assert rabbit.held(queue) == 0
    assert consumer.runner.reconnects == 0


def _exists(rabbit: Broker, queue: str) -> bool:
    try:
        rabbit.channel.queue_declare(queue, passive=True)
        return True
    except pika.exceptions.ChannelClosedByBroker:
        return False


def test_the_consumed_queue_deleted_while_running_names_the_queue_and_the_fix(
    pg: Any, rabbit: Broker
) -> None:
    """Without ``declare`` the runner cannot consume again after the broker's cancel: its
    TopologyError names the queue and says how to get it back; the message already applied
    stays applied once."""
    queue = rabbit.queue()
    consumer = Consumer(pg, rabbit, queue)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            consumer.runner.run()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    rabbit.publish(queue, body(n=1), "m-1")
    wait_until(lambda: consumer.applied() == ["m-1"], "m-1 applied")
    rabbit.channel.queue_delete(queue)
    thread.join(30)
    assert not thread.is_alive()
    [error] = errors
    assert isinstance(error, TopologyError)
    assert repr(queue) in str(error) and "RabbitConfig(declare=True)" in str(error), error
    assert consumer.applied() == ["m-1"]
