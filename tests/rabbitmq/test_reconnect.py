"""RabbitConsumerRunner when the broker keeps closing things: connections that drop again
and again (real broker, through a proxy). A dead-letter exchange that does not exist:
tests/rabbitmq/test_dead_letter_missing.py."""

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

from tests.rabbitmq.test_runner import Consumer, body
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401
from tests.support.tcp_proxy import Proxy


def wait_for(condition: Callable[[], object], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


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
