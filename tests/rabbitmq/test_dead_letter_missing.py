"""A dead letter with nowhere to go stops the runner with a clear error (issue 38, item 5,
the RabbitMQ half); real broker and PostgreSQL.

A ``dead_letter_exchange`` that does not exist, or no queue bound for the dead letters,
with ``declare=False``: before, the runner took it for "not there yet". The FAILED delivery
was requeued and came back again and again, each time after a longer pause of the whole
runner (up to ``max_retry_delay``), one ERROR line each time, and ``run(until_idle=True)``
never returned. Now it is a setup fault: ``DeadLetterMissing`` (a TopologyError and a
ConfigurationError) names what is missing and the fix, the delivery stays in the queue,
and the runner restarted once the topology is fixed dead-letters it.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest

from consumerdedup import ConfigurationError, Outcome
from consumerdedup.adapters.rabbitmq import DeadLetterMissing, TopologyError
from consumerdedup.headers import REASON_HEADER
from tests.rabbitmq.test_runner import Consumer, body
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401

pytestmark = pytest.mark.postgres

BOUND = 30.0
"""Seconds run(until_idle=True) has to end, by itself, on the fault."""
PAUSES = {"retry_delay": timedelta(milliseconds=50), "max_retry_delay": timedelta(seconds=1)}


def run_bounded(consumer: Consumer) -> BaseException | None:
    """What ``run(until_idle=True)`` raised; fails the test if it did not end within BOUND
    seconds (it is stopped then, so the test ends either way)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            consumer.runner.run(until_idle=True)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(BOUND)
    if thread.is_alive():
        consumer.runner.stop()
        thread.join(30)
        pytest.fail(f"run(until_idle=True) went on for {BOUND:g} s: a dead letter held it")
    return raised[0] if raised else None


@pytest.mark.parametrize("batch_size", [1, 2])
def test_a_dead_letter_exchange_that_does_not_exist_stops_the_runner(
    pg: Any, rabbit: Broker, batch_size: int
) -> None:
    queue, exchange = rabbit.queue(), rabbit.name("dlx")  # the exchange is never declared
    rabbit.publish(queue, body(refuse="bad"), "m-1")
    rabbit.publish(queue, body(n=2), "m-2")
    consumer = Consumer(
        pg, rabbit, queue, dead_letter_exchange=exchange, batch_size=batch_size, **PAUSES
    )
    started = time.monotonic()
    error = run_bounded(consumer)
    assert isinstance(error, DeadLetterMissing), error
    assert isinstance(error, TopologyError) and isinstance(error, ConfigurationError)
    assert time.monotonic() - started < 10
    message = str(error)
    assert f"the dead-letter exchange {exchange!r} does not exist" in message
    assert "RabbitConfig(declare=True)" in message and repr(queue + ".dlq") in message
    assert consumer.runner.outcomes[Outcome.FAILED] == 1  # not requeued and read again
    assert rabbit.held(queue) == 2  # nothing of the batch acked: m-1 is not lost
    assert consumer.applied() == ([] if batch_size == 1 else ["m-2"])

    # The topology fixed, the restarted runner dead-letters m-1; m-2 is applied once.
    rabbit.channel.exchange_declare(exchange, exchange_type="direct", durable=True)
    rabbit.channel.queue_bind(queue + ".dlq", exchange, routing_key=queue + ".dlq")
    fixed = Consumer(pg, rabbit, queue, consumer.ledger, dead_letter_exchange=exchange)
    fixed.runner.run(until_idle=True)
    [(props, _)] = rabbit.peek(queue + ".dlq")
    assert props.message_id == "m-1"
    assert props.headers[REASON_HEADER] == "RecordedFailure: PermanentError: bad"
    assert fixed.applied() == ["m-2"]
    assert rabbit.held(queue) == 0


def test_no_dead_letter_queue_on_the_default_exchange_stops_the_runner(
    pg: Any, rabbit: Broker
) -> None:
    queue = rabbit.queue(dead_letter=False)  # no <queue>.dlq: the dead letter is unroutable
    rabbit.publish(queue, body(refuse="bad"), "m-1")
    consumer = Consumer(pg, rabbit, queue, **PAUSES)
    error = run_bounded(consumer)
    assert isinstance(error, DeadLetterMissing), error
    message = str(error)
    assert "no queue is bound for its dead letters (the default exchange" in message
    assert f"declare the dead-letter queue {queue + '.dlq'!r}" in message
    assert rabbit.held(queue) == 1

    rabbit.channel.queue_declare(queue + ".dlq", durable=True)
    fixed = Consumer(pg, rabbit, queue, consumer.ledger)
    fixed.runner.run(until_idle=True)
    [(props, _)] = rabbit.peek(queue + ".dlq")
    assert props.message_id == "m-1"
    assert rabbit.held(queue) == 0
