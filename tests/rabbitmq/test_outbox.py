"""The outbox relay publishing to the real RabbitMQ, and a deduplicating consumer downstream.

The scenarios every broker shares are in tests/contracts/outbox.py; the outage is
RabbitMQ's own (a proxy cut between the relay and the broker)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from consumerdedup import OutboxRelay, Outcome, RelayConfig
from consumerdedup.adapters.rabbitmq import RabbitConfig, RabbitConsumerRunner, RabbitPublisher
from tests.conftest import database
from tests.contracts.outbox import RelayToBrokerContract
from tests.support.outbox_events import Downstream, add_events, assert_drained
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401
from tests.support.tcp_proxy import Proxy


class RabbitSide:
    """Destinations are queues; downstream is a RabbitConsumerRunner, as in production."""

    def __init__(self, db: Any, rabbit: Broker) -> None:
        self.db = db
        self.rabbit = rabbit

    def publisher(self) -> RabbitPublisher:
        return RabbitPublisher(self.rabbit.url)

    def destination(self) -> str:
        return self.rabbit.queue("outbox")

    def held(self, destination: str) -> list[tuple[str, int, str]]:
        found = []
        for properties, body in self.rabbit.peek(destination):
            key, seq = body.decode().split(":")
            found.append((key, int(seq), properties.message_id))
        return found

    def consume(self, destination: str, downstream: Downstream) -> Counter[Outcome]:
        config = RabbitConfig(batch_size=100)
        url = self.rabbit.url
        runner = RabbitConsumerRunner(downstream.handler, destination, url=url, config=config)
        runner.run(until_idle=True)
        assert self.rabbit.held(destination) == 0
        return Counter(runner.outcomes)


@pytest.fixture(params=["postgresql", "mariadb"])
def outbox_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """The shared scenarios' database: PostgreSQL and MariaDB (row locks, no NOTIFY)."""
    yield from database(request, request.param, tmp_path)


class TestRelayToRabbitMQ(RelayToBrokerContract):
    @pytest.fixture
    def broker_side(self, outbox_db: Any, rabbit: Broker) -> RabbitSide:
        return RabbitSide(outbox_db, rabbit)


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
        assert_drained(relay)
        proxy.cut()
        later = add_events(pg, queue, 100, keys=5)
        time.sleep(2)  # the broker is away this long; the relay must keep trying
        assert relay.backlog() > 0
        proxy.restore()
        assert_drained(relay)
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
