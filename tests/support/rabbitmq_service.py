"""Find the RabbitMQ broker the tests use, and small broker-side helpers for them.

Order: CONSUMERDEDUP_TEST_AMQP_URL; the local default (127.0.0.1:5672, guest/guest)
if the port answers; testcontainers' RabbitMQ when a Docker engine answers;
otherwise ``services.unavailable`` (a skip locally, a failure in CI).
Tests import the fixtures ``amqp_url`` and ``rabbit``:
``from tests.support.rabbitmq_service import amqp_url_fixture, rabbit_fixture  # noqa: F401``.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pika
import pika.exceptions
import pytest

from tests.support import services

AMQP_DEFAULT = "amqp://guest:guest@127.0.0.1:5672/%2F"
RABBITMQCTL_NEEDED = (
    "a queue's message TTL is read with rabbitmqctl on the broker's host (documented): "
    "run the tests there, with rabbitmqctl on PATH"
)


def rabbitmq_url() -> str:
    url = os.environ.get("CONSUMERDEDUP_TEST_AMQP_URL")
    if url:
        return url
    if services.answers("127.0.0.1", 5672):
        return AMQP_DEFAULT
    if services.docker_answers():
        try:
            from testcontainers.community.rabbitmq import RabbitMqContainer
        except ImportError:  # testcontainers before the community/ layout
            from testcontainers.rabbitmq import RabbitMqContainer

        container = RabbitMqContainer("rabbitmq:3-alpine")
        container.start()
        atexit.register(container.stop)
        host, port = container.get_container_host_ip(), container.get_exposed_port(5672)
        return f"amqp://guest:guest@{host}:{port}/%2F"
    services.unavailable(
        "no RabbitMQ: set CONSUMERDEDUP_TEST_AMQP_URL, start one on 127.0.0.1:5672 "
        "(rabbitmq-server -detached), or run a Docker engine for testcontainers"
    )


@pytest.fixture(scope="session", name="amqp_url")
def amqp_url_fixture() -> str:
    return rabbitmq_url()


class Broker:
    """Test-side view of the broker: queues to create, fill, count and delete."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.names: list[str] = []
        self._connection: Any = None
        self._channel: Any = None

    @property
    def connection(self) -> Any:
        """The test's own connection, reopened if the broker side closed it."""
        try:
            if self._connection is not None:
                self._connection.process_data_events(0)  # raises if it was closed remotely
                if self._connection.is_open:
                    return self._connection
        except pika.exceptions.AMQPConnectionError:
            pass
        self._connection = pika.BlockingConnection(pika.URLParameters(self.url))
        self._channel = None
        return self._connection

    @property
    def channel(self) -> Any:
        """A confirming channel, reopened after a channel error (a 404 closes it)."""
        connection = self.connection
        if self._channel is None or not self._channel.is_open:
            self._channel = connection.channel()
            self._channel.confirm_delivery()
        return self._channel

    def name(self, prefix: str = "t") -> str:
        """A fresh queue or exchange name; whatever has it is deleted at teardown."""
        name = f"cdd-{prefix}-{uuid.uuid4().hex[:10]}"
        self.names += [name, name + ".dlq"]
        return name

    def queue(self, prefix: str = "t", *, dead_letter: bool = True) -> str:
        """A fresh durable queue and its ``.dlq``, declared as ``RabbitConfig(declare=True)``
        would; ``dead_letter=False``: a plain queue and no ``.dlq``."""
        name = self.name(prefix)
        arguments = None
        if dead_letter:
            self.channel.queue_declare(name + ".dlq", durable=True)
            arguments = {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": name + ".dlq"}
        self.channel.queue_declare(name, durable=True, arguments=arguments)
        return name

    def publish(
        self, queue: str, body: bytes, message_id: str | None = None, **properties: Any
    ) -> None:
        """Publish to ``queue`` through the default exchange, confirmed."""
        props = pika.BasicProperties(message_id=message_id, delivery_mode=2, **properties)
        self.channel.basic_publish("", queue, body, props, mandatory=True)

    def ready(self, queue: str) -> int:
        return int(self.channel.queue_declare(queue, passive=True).method.message_count)

    def held(self, queue: str, timeout: float = 20.0) -> int:
        """Ready plus unacked: waits until no consumer is attached, then unacked is zero."""
        deadline = time.monotonic() + timeout
        while True:
            ok = self.channel.queue_declare(queue, passive=True).method
            if ok.consumer_count == 0 or time.monotonic() > deadline:
                assert ok.consumer_count == 0, f"{queue} still has a consumer"
                return int(ok.message_count)
            time.sleep(0.05)

    def reaches(self, queue: str, count: int, timeout: float = 20.0) -> int:
        """Waits until ``queue`` holds ``count`` messages (dead-lettering is asynchronous:
        a nack returns before the message lands in the DLQ); returns what it holds then."""
        deadline = time.monotonic() + timeout
        while True:
            held = self.held(queue, timeout)
            if held == count or time.monotonic() > deadline:
                return held
            time.sleep(0.02)

    def peek(self, queue: str) -> list[tuple[Any, bytes]]:
        """(properties, body) of every ready message of ``queue``, left in place, in order."""
        out = []
        channel = self.connection.channel()
        while True:
            method, properties, body = channel.basic_get(queue, auto_ack=False)
            if method is None:
                break
            out.append((properties, body))
        channel.close()  # gives every message back, in order
        return out

    def close(self) -> None:
        for name in self.names:
            self.channel.queue_delete(name)
            self.channel.exchange_delete(name)
        self.connection.close()


@pytest.fixture(name="rabbit")
def rabbit_fixture(amqp_url: str) -> Iterator[Broker]:
    """The broker seen from the test side; the queues it made are deleted afterwards."""
    b = Broker(amqp_url)
    yield b
    b.close()


def named_connections(ctl: str) -> list[tuple[str, str]]:
    """(pid, client-provided name) of each broker connection that has a name, read with
    ``rabbitmqctl`` at ``ctl``."""
    listing = subprocess.run(
        [ctl, "list_connections", "pid", "client_properties", "-q", "--no-table-headers"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    found = []
    for line in listing.splitlines():
        if named := re.search(r'\{"connection_name","([^"]*)"\}', line):
            found.append((line.split("\t")[0], named.group(1)))
    return found


def close_connection(url: str, name: str, reason: str = "closed by the test") -> None:
    """Close, from the broker side, the connection whose client-provided name is ``name``.

    Uses rabbitmqctl, so only for a broker on this machine (the CI and dev default).
    """
    ctl = shutil.which("rabbitmqctl")
    if ctl is None or pika.URLParameters(url).host not in ("127.0.0.1", "localhost"):
        services.unavailable(
            "closing a connection from the broker side needs rabbitmqctl and a local broker"
        )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pids = [pid for pid, named in named_connections(ctl) if named == name]
        if pids:
            for pid in pids:
                subprocess.run([ctl, "close_connection", pid, reason], timeout=60, check=True)
            return
        time.sleep(0.2)
    raise AssertionError(f"no broker connection named {name!r}")
