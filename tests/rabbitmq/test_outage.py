"""The broker gone for a while (as in a restart), without restarting the shared broker:
the runner talks to it through a TCP proxy that the test cuts and brings back."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Any

import pika
from sqlalchemy import text

from consumerdedup import Deduplicator, Message
from consumerdedup.adapters.rabbitmq import RabbitConfig, RabbitConsumerRunner
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401
from tests.support.tcp_proxy import Proxy


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
    # The cut lands mid-stream by construction: the 300th handler call holds until the proxy
    # is cut (polling for '>= 300 rows' left it to the scheduler how far the runner got).
    calls: list[str] = []
    at_300, cut = threading.Event(), threading.Event()

    @dedup.handler
    def apply(message: Message, session: Any) -> None:
        calls.append(message.id)
        if len(calls) == 300:
            at_300.set()
            assert cut.wait(60), "the proxy was never cut"  # a hang guard
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
        wait_for(at_300.is_set, "the 300th message")
        proxy.cut()
        cut.set()
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
