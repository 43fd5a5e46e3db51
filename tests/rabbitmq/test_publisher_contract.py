"""RabbitPublisher passes the shared publisher contract, on the real broker."""

from __future__ import annotations

from datetime import timedelta

import pytest

from consumerdedup import Publisher
from consumerdedup.adapters.rabbitmq import RabbitPublisher
from tests.contracts.publisher import PublisherCapabilities, PublisherContract, Received
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401


class RabbitPublisherHarness:
    """Destinations are queues reached through the default exchange; a consumer takes the
    AMQP ``message_id`` as the id."""

    capabilities = PublisherCapabilities(creates_destinations=False, can_be_away=True)

    def __init__(self, rabbit: Broker) -> None:
        self.rabbit = rabbit

    def publisher(self) -> Publisher:
        return RabbitPublisher(self.rabbit.url)

    def unreachable(self) -> Publisher:
        url = "amqp://guest:guest@127.0.0.1:1/%2F"
        return RabbitPublisher(url, attempts=1, connect_timeout=timedelta(seconds=1))

    def destination(self) -> str:
        return self.rabbit.queue("publisher", dead_letter=False)

    def missing(self) -> str:
        return self.rabbit.name("missing")  # no queue bound: mandatory makes it unroutable

    def received(self, destination: str) -> list[Received]:
        return [
            Received(properties.message_id, body, dict(properties.headers or {}))
            for properties, body in self.rabbit.peek(destination)
        ]


class TestRabbitPublisher(PublisherContract):
    @pytest.fixture
    def harness(self, rabbit: Broker) -> RabbitPublisherHarness:
        return RabbitPublisherHarness(rabbit)
