"""A relay and a runner that sit idle on RabbitMQ keep their connection (issue 38, item 9).

pika's BlockingConnection answers heartbeats only while it is called. The relay's publisher
used to sit silent between quiet periods: the broker dropped it after about two heartbeat
intervals, and the next publish met the dead socket, with a burst of ERROR lines and
tracebacks from pika's own loggers before the reconnect. Now the publisher answers
heartbeats while idle (a keep-alive thread), and a connection lost anyway is reopened with
one WARNING line of ours and no traceback.

Real RabbitMQ and PostgreSQL. Heartbeat 1 s (measured: the broker drops a client silent for
3.3 s, keeps one silent for 3.0 s); the idle periods are IDLE = 4.5 s, past that.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from consumerdedup import OutboxRelay, RelayConfig
from consumerdedup.adapters.rabbitmq import RabbitPublisher
from tests.rabbitmq.test_runner import Consumer, body
from tests.support.outbox_events import add_events, assert_drained
from tests.support.rabbitmq_service import (  # noqa: F401
    Broker,
    amqp_url_fixture,
    close_connection,
    rabbit_fixture,
)

pytestmark = pytest.mark.postgres

HEARTBEAT = {"heartbeat": 1}
IDLE = 4.5
"""Seconds of quiet: past what the broker allows a silent client at heartbeat 1 (3.3 s)."""


def wait_until(condition: Callable[[], object], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def noise(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What an operator would call a flood: ERROR lines, and any line at INFO or above with
    a traceback."""
    return [
        f"{r.name} {r.levelname}: {r.getMessage()[:200]}"
        for r in caplog.records
        if r.levelno >= logging.ERROR or (r.exc_info and r.levelno >= logging.INFO)
    ]


def reconnect_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "reconnect" in r.getMessage().lower()]


def start(relay: OutboxRelay) -> Callable[[], None]:
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()

    def stop() -> None:
        relay.stop()
        thread.join(30)
        assert not thread.is_alive()

    return stop


def relay_over(pg: Any, publisher: RabbitPublisher) -> OutboxRelay:
    config = RelayConfig(
        poll_interval=timedelta(milliseconds=200),
        initial_backoff=timedelta(milliseconds=100),
        max_backoff=timedelta(milliseconds=500),
    )
    return OutboxRelay(pg.engine, publisher, tables=pg.tables, config=config)


def test_an_idle_relay_keeps_its_connection_and_logs_nothing(
    pg: Any, rabbit: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """Publish, stay quiet for more than three heartbeat intervals, publish again: every
    event arrives, the publisher never reconnected, and nothing was logged at ERROR or with
    a traceback (before: pika's loggers wrote ERROR lines and tracebacks for the connection
    the broker had reset, then the publisher reconnected)."""
    caplog.set_level(logging.INFO)
    queue = rabbit.queue("idle-relay")
    publisher = RabbitPublisher(rabbit.url, connection_options=HEARTBEAT)
    relay = relay_over(pg, publisher)
    stop = start(relay)
    try:
        first = add_events(pg, queue, 5, keys=1)
        assert_drained(relay)
        time.sleep(IDLE)  # the scenario itself: a quiet period, not a wait for something
        second = add_events(pg, queue, 5, keys=1)
        assert_drained(relay)
    finally:
        stop()
    held = [properties.message_id for properties, _ in rabbit.peek(queue)]
    assert held == first + second
    assert noise(caplog) == []
    assert publisher.reconnects == 0
    assert reconnect_lines(caplog) == []


def test_a_relay_whose_connection_is_closed_while_idle_reconnects_with_one_line(
    pg: Any, rabbit: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """The broker closes the idle publisher's connection (an operator, a broker restart):
    the next round publishes on a new connection, with one WARNING line and no traceback."""
    caplog.set_level(logging.INFO)
    queue = rabbit.queue("closed-relay")
    name = f"cdd-idle-publisher-{uuid.uuid4().hex[:8]}"
    publisher = RabbitPublisher(rabbit.url, connection_name=name, connection_options=HEARTBEAT)
    relay = relay_over(pg, publisher)
    stop = start(relay)
    try:
        first = add_events(pg, queue, 3, keys=1)
        assert_drained(relay)
        close_connection(rabbit.url, name)
        wait_until(lambda: publisher.reconnects or reconnect_lines(caplog), "the loss to be seen")
        second = add_events(pg, queue, 3, keys=1)
        assert_drained(relay)
    finally:
        stop()
    held = [properties.message_id for properties, _ in rabbit.peek(queue)]
    assert held == first + second
    assert noise(caplog) == []
    [line] = reconnect_lines(caplog)
    assert line.levelno == logging.WARNING and not line.exc_info
    assert name in line.getMessage()


def test_an_idle_runner_keeps_its_connection(
    pg: Any, rabbit: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """The consumer runner waits for deliveries inside pika (process_data_events), so it
    answers heartbeats while its queue is quiet: no reconnect, nothing at ERROR."""
    caplog.set_level(logging.INFO)
    queue = rabbit.queue("idle-runner")
    consumer = Consumer(pg, rabbit, queue, connection_options=HEARTBEAT)
    stop = consumer.start()
    try:
        rabbit.publish(queue, body(n=1), "m-1")
        wait_until(lambda: consumer.applied() == ["m-1"], "m-1 applied")
        time.sleep(IDLE)  # the scenario itself: a quiet queue
        rabbit.publish(queue, body(n=2), "m-2")
        wait_until(lambda: consumer.applied() == ["m-1", "m-2"], "m-2 applied")
    finally:
        stop()
    assert consumer.runner.reconnects == 0
    assert noise(caplog) == []


KEEPER = "consumerdedup-rabbitmq-keepalive"


def keepers(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before and t.name == KEEPER]


def test_the_keep_alive_thread_ends_with_close_and_with_a_publisher_dropped_unclosed(
    rabbit: Broker,
) -> None:
    queue = rabbit.queue("keeper")
    before = set(threading.enumerate())
    closed = RabbitPublisher(rabbit.url, connection_options=HEARTBEAT)
    closed.publish(queue, b"1", headers={"event_id": "e-1"})
    [keeper] = keepers(before)
    closed.close()
    wait_until(lambda: not keeper.is_alive(), "the thread of a closed publisher to end")

    dropped = RabbitPublisher(rabbit.url, connection_options=HEARTBEAT)
    dropped.publish(queue, b"2", headers={"event_id": "e-2"})
    [keeper] = keepers(before)
    del dropped  # never closed: the thread holds its owner weakly
    gc.collect()
    wait_until(lambda: not keeper.is_alive(), "the thread of a dropped publisher to end")
    assert [p.message_id for p, _ in rabbit.peek(queue)] == ["e-1", "e-2"]


def test_a_runner_whose_connection_is_closed_reconnects_with_one_line(
    pg: Any, rabbit: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """The broker closes the runner's connection (an operator, a broker restart): it
    reconnects and goes on, saying so in one WARNING line of its own; pika's lines about
    the loss (an ERROR before) are DEBUG."""
    caplog.set_level(logging.INFO)
    queue = rabbit.queue("closed-runner")
    name = f"cdd-closed-runner-{uuid.uuid4().hex[:8]}"
    consumer = Consumer(pg, rabbit, queue, connection_name=name)
    stop = consumer.start()
    try:
        rabbit.publish(queue, body(n=1), "m-1")
        wait_until(lambda: consumer.applied() == ["m-1"], "m-1 applied")
        close_connection(rabbit.url, name)
        wait_until(lambda: consumer.runner.reconnects == 1, "the reconnect")
        rabbit.publish(queue, body(n=2), "m-2")
        wait_until(lambda: consumer.applied() == ["m-1", "m-2"], "m-2 applied")
    finally:
        stop()
    assert noise(caplog) == []
    [line] = reconnect_lines(caplog)
    assert line.levelno == logging.WARNING and not line.exc_info and name in line.getMessage()
