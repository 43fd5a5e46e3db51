"""The outbox relay publishing to the real RabbitMQ, and a deduplicating consumer downstream."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text

from consumerdedup import (
    OutboxRelay,
    Outcome,
    RelayConfig,
    SimulatedCrash,
)
from consumerdedup.adapters.rabbitmq import RabbitConfig, RabbitConsumerRunner, RabbitPublisher
from tests.support.outbox_events import Downstream, add_events
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401
from tests.support.tcp_proxy import Proxy

FAST = RelayConfig(batch_size=200, poll_interval=timedelta(seconds=0.2))


def consume_downstream(db: Any, url: str, queue: str) -> tuple[Downstream, dict[Outcome, int]]:
    """Apply every event once, through a RabbitMQ runner."""
    downstream = Downstream(db)
    config = RabbitConfig(batch_size=100)
    runner = RabbitConsumerRunner(downstream.handler, queue, url=url, config=config)
    runner.run(until_idle=True)
    return downstream, dict(runner.outcomes)


@pytest.mark.slow
def test_ten_thousand_events_through_three_relays_each_applied_once_in_key_order(
    pg: Any, rabbit: Broker, amqp_url: str
) -> None:
    queue = rabbit.queue("outbox")
    ids = add_events(pg, queue, 10_000, keys=50)
    relays = [
        OutboxRelay(pg.engine, RabbitPublisher(amqp_url), tables=pg.tables, config=FAST)
        for _ in range(3)
    ]
    threads = [threading.Thread(target=relay.run) for relay in relays]
    for thread in threads:
        thread.start()
    try:
        assert relays[0].wait_drained(300)
    finally:
        for relay in relays:
            relay.stop()
        for thread in threads:
            thread.join(30)
    # Several relays never publish a row twice while it is in flight (the README), and
    # nothing failed here: every event is on the queue exactly once.
    assert sum(r.published for r in relays) == len(ids)
    assert all(r.published > 0 for r in relays), [r.published for r in relays]
    assert rabbit.held(queue) == len(ids)

    downstream, outcomes = consume_downstream(pg, amqp_url, queue)
    rows = downstream.applied()
    assert sorted(event_id for _, _, event_id in rows) == sorted(ids)  # each exactly once
    assert outcomes == {Outcome.PROCESSED: len(ids)}  # and no duplicate to answer
    per_key: dict[str, list[int]] = defaultdict(list)
    for key, seq, _ in rows:
        per_key[key].append(seq)
    assert len(per_key) == 50
    for key, seqs in per_key.items():
        assert seqs == sorted(seqs), f"{key} applied out of order"
    assert rabbit.held(queue) == 0


def test_relay_killed_after_the_confirm_republishes_and_downstream_answers_duplicate(
    pg: Any, rabbit: Broker, amqp_url: str
) -> None:
    queue = rabbit.queue("outbox")
    ids = add_events(pg, queue, 6, keys=2)
    real = RabbitPublisher(amqp_url)

    class DiesAfterConfirm:
        def __init__(self) -> None:
            self.count = 0

        def publish(self, destination: str, body: bytes, key: Any = None, headers: Any = None):  # type: ignore[no-untyped-def]
            real.publish(destination, body, key, headers)  # the broker confirmed it
            self.count += 1
            if self.count == 3:
                raise SimulatedCrash("relay killed before marking its rows published")

    with pytest.raises(SimulatedCrash):
        OutboxRelay(pg.engine, DiesAfterConfirm(), tables=pg.tables, config=FAST).run_once()
    assert rabbit.held(queue) == 3
    assert OutboxRelay(pg.engine, real, tables=pg.tables, config=FAST).drain() == 6
    assert rabbit.held(queue) == 9  # the first three went twice: at least once

    downstream, outcomes = consume_downstream(pg, amqp_url, queue)
    assert sorted(e for _, _, e in downstream.applied()) == sorted(ids)
    assert outcomes == {Outcome.PROCESSED: 6, Outcome.DUPLICATE: 3}


def test_broker_away_for_seconds_the_relay_backs_off_then_publishes_everything(
    pg: Any, rabbit: Broker, amqp_url: str
) -> None:
    from urllib.parse import urlsplit

    queue = rabbit.queue("outbox")
    target = urlsplit(amqp_url)
    proxy = Proxy(target.hostname or "127.0.0.1", target.port or 5672)
    proxied = amqp_url.replace(f":{target.port or 5672}/", f":{proxy.port}/")
    publisher = RabbitPublisher(proxied, attempts=1)
    config = RelayConfig(
        batch_size=20,
        poll_interval=timedelta(seconds=0.1),
        initial_backoff=timedelta(milliseconds=100),
        max_backoff=timedelta(milliseconds=500),
    )
    relay = OutboxRelay(pg.engine, publisher, tables=pg.tables, config=config)
    thread = threading.Thread(target=relay.run)
    thread.start()
    try:
        first = add_events(pg, queue, 100, keys=5)
        assert relay.wait_drained(60)
        proxy.cut()
        later = add_events(pg, queue, 100, keys=5)
        time.sleep(2)  # the broker is away this long; the relay must keep trying
        assert relay.backlog() > 0
        proxy.restore()
        assert relay.wait_drained(60)
    finally:
        relay.stop()
        thread.join(30)
        proxy.cut()
    delivered = {properties.message_id for properties, _ in rabbit.peek(queue)}
    assert delivered == set(first + later)
    with pg.engine.connect() as conn:
        ob = pg.tables.outbox
        attempts = conn.execute(text(f"SELECT max(attempts) FROM {ob.fullname}")).scalar()
    assert attempts == 0  # the outage charged no event, so none can be parked by it
