"""The broker gone for a while (as in a restart), without restarting the shared broker:
the runner talks to it through a TCP proxy that the test cuts and brings back."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import pika
from sqlalchemy import text

from consumerdedup import Deduplicator, Message
from consumerdedup.adapters.rabbitmq import RabbitConfig, RabbitConsumerRunner
from tests.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401


class Proxy:
    """Forwards a local port to the broker; ``cut()`` resets every connection and refuses
    new ones until ``restore()``, as a broker that went down and came back would."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.port = 0
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        self.restore()

    def restore(self) -> None:
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", self.port))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def cut(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked on it
        self.listener.close()
        with self.lock:
            for sock in self.sockets:
                # Both ends see the stream end with no AMQP goodbye. shutdown() first: a bare
                # close() would not wake the pump blocked in recv(), and the socket would linger.
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self.sockets.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            with self.lock:
                self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def test_the_broker_gone_for_seconds_mid_stream_is_waited_for_and_nothing_is_lost(
    pg: Any, rabbit: Broker
) -> None:
    total = 1500
    ledger = pg.create_ledger()
    queue = rabbit.queue("outage")
    for i in range(total):
        rabbit.publish(queue, json.dumps({"n": i}).encode(), f"m-{i:05d}")
    params = pika.URLParameters(rabbit.url)
    proxy = Proxy(params.host, params.port)
    creds = params.credentials
    url = f"amqp://{creds.username}:{creds.password}@127.0.0.1:{proxy.port}/%2F"

    dedup = Deduplicator(pg.engine, consumer="ledger", tables=pg.tables)

    @dedup.handler
    def apply(message: Message, session: Any) -> None:
        time.sleep(0.001)
        session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', 1, :m)"),
            {"m": message.id},
        )

    config = RabbitConfig(
        batch_size=10,
        reconnect_delay=timedelta(milliseconds=100),
        max_reconnect_delay=timedelta(milliseconds=500),
    )
    runner = RabbitConsumerRunner(apply, queue, url=url, config=config)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()

    def rows() -> int:
        return int(pg.scalar(f"SELECT count(DISTINCT message_id) FROM {ledger}"))

    def wait_for(condition: Any, what: str) -> None:
        deadline = time.monotonic() + 120
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    try:
        wait_for(lambda: rows() >= 300, "300 rows")
        proxy.cut()
        wait_for(lambda: runner.reconnects >= 1, "the runner to notice")
        time.sleep(2)  # down for a while: the runner keeps trying, with backoff
        stalled = rows()
        assert stalled < total
        proxy.restore()
        wait_for(lambda: rows() == total, "every message")
    finally:
        runner.stop()
        thread.join(30)
        proxy.cut()
    assert not thread.is_alive()
    assert pg.scalar(f"SELECT count(*) FROM {ledger}") == total
    assert rabbit.held(queue) == 0
