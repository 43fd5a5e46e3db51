"""RabbitConsumerRunner when the broker keeps closing things: a dead-letter exchange that
does not exist, and connections that drop again and again (real broker, through a proxy)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pika
import pytest

from consumerdedup import Outcome
from consumerdedup.headers import REASON_HEADER
from tests.rabbitmq.test_runner import Consumer, body
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401
from tests.support.tcp_proxy import Proxy


def wait_for(condition: Callable[[], object], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.parametrize("batch_size", [1, 2])
def test_a_missing_dead_letter_exchange_holds_back_the_refused_message_only(
    pg: Any, rabbit: Broker, batch_size: int
) -> None:
    queue, exchange = rabbit.queue(), rabbit.name("dlx")  # the exchange is never declared
    rabbit.publish(queue, body(refuse="bad"), "m-1")
    rabbit.publish(queue, body(n=2), "m-2")
    consumer = Consumer(
        pg,
        rabbit,
        queue,
        dead_letter_exchange=exchange,
        batch_size=batch_size,
        retry_delay=timedelta(milliseconds=50),
        max_retry_delay=timedelta(milliseconds=200),
    )
    stop = consumer.start()
    try:
        wait_for(lambda: consumer.applied() == ["m-2"], "the good message")
        wait_for(lambda: consumer.runner.outcomes[Outcome.FAILED] >= 4, "the refusal again")
    finally:
        stop()

    assert consumer.runner.reconnects == 0  # a refused dead letter is not a lost connection
    assert consumer.runner.outcomes[Outcome.PROCESSED] == 1
    assert consumer.runner.outcomes[Outcome.DUPLICATE] == 0  # m-2 was acked the first time
    assert consumer.applied() == ["m-2"]
    [(props, _)] = rabbit.peek(queue)  # only the refused message is still queued
    assert props.message_id == "m-1"
    assert rabbit.held(queue + ".dlq") == 0

    # Once the exchange exists, the held message is dead-lettered and the queue empties.
    rabbit.channel.exchange_declare(exchange, exchange_type="direct", durable=True)
    rabbit.channel.queue_bind(queue + ".dlq", exchange, routing_key=queue + ".dlq")
    Consumer(pg, rabbit, queue, consumer.ledger, dead_letter_exchange=exchange).runner.run(
        until_idle=True
    )
    [(props, _)] = rabbit.peek(queue + ".dlq")
    assert props.message_id == "m-1" and "bad" in props.headers[REASON_HEADER]
    assert rabbit.held(queue) == 0


def test_reconnect_delays_grow_while_connections_keep_dropping_and_reset_after_progress(
    pg: Any, rabbit: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    queue = rabbit.queue()
    params = pika.URLParameters(rabbit.url)
    proxy = Proxy(params.host, params.port)
    creds = params.credentials
    url = f"amqp://{creds.username}:{creds.password}@127.0.0.1:{proxy.port}/%2F"
    consumer = Consumer(
        pg,
        SimpleNamespace(url=url),
        queue,
        reconnect_delay=timedelta(milliseconds=100),
        max_reconnect_delay=timedelta(milliseconds=800),
        prefetch=1,  # m-2 below is delivered only once the broker has m-1's ack
        batch_size=1,
    )
    caplog.set_level(logging.INFO, logger="consumerdedup.rabbitmq")

    def consuming() -> int:
        """basic_consume calls the runner has completed (it logs each one)."""
        return sum(" consuming " in record.getMessage() for record in list(caplog.records))

    thread = threading.Thread(target=consumer.runner.run, daemon=True)
    thread.start()

    def drop() -> float:
        """Drop the runner's connection once it is consuming; how long until the next one."""
        # Cut only a connection past its handshake and basic_consume: a cut during the
        # handshake would measure connect()'s own retry, not the runner's reconnect delay.
        wait_for(lambda: consuming() >= len(proxy.accepted), "the runner to consume again")
        count = len(proxy.accepted)
        cut = time.monotonic()
        proxy.cut()
        proxy.restore()
        wait_for(lambda: len(proxy.accepted) > count, "a reconnection")
        return proxy.accepted[count] - cut

    try:
        wait_for(lambda: proxy.accepted, "the first connection")
        gaps = [drop() for _ in range(5)]
        # Progress (a message handled and acked) starts the backoff over.
        rabbit.publish(queue, body(n=1), "m-1")
        rabbit.publish(queue, body(n=2), "m-2")
        wait_for(lambda: consumer.applied() == ["m-1", "m-2"], "m-2, sent once m-1 was acked")
        after_progress = drop()
    finally:
        consumer.runner.stop()
        thread.join(30)
        proxy.cut()
    assert not thread.is_alive()
    assert consumer.runner.reconnects == 6
    # 0.1, 0.2, 0.4, 0.8, 0.8 s (capped), each plus up to 0.1 s of jitter.
    assert gaps[0] < 0.45, gaps
    assert gaps[3] > 0.7 and gaps[4] > 0.7, gaps
    assert max(gaps) < 0.8 + 0.1 + 0.5, gaps
    assert after_progress < 0.45, (gaps, after_progress)
