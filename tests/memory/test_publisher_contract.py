"""The MemoryBroker passes the shared publisher contract."""

from __future__ import annotations

import itertools

import pytest

from consumerdedup import Publisher
from consumerdedup.testing import MemoryBroker
from tests.contracts.publisher import PublisherCapabilities, PublisherContract, Received

_names = itertools.count(1)


class MemoryPublisherHarness:
    """Its queues exist once named, and it is in the process: it cannot be away."""

    capabilities = PublisherCapabilities(creates_destinations=True, can_be_away=False)

    def __init__(self) -> None:
        self.broker = MemoryBroker()

    def publisher(self) -> Publisher:
        return self.broker

    def unreachable(self) -> Publisher:
        raise AssertionError("an in-process broker is never away")

    def destination(self) -> str:
        return f"queue-{next(_names)}"

    def missing(self) -> str:
        return f"missing-{next(_names)}"

    def received(self, destination: str) -> list[Received]:
        return [
            Received(message.id, message.body, dict(message.headers))
            for message in self.broker.messages(destination)
        ]


class TestMemoryPublisher(PublisherContract):
    @pytest.fixture
    def harness(self) -> MemoryPublisherHarness:
        return MemoryPublisherHarness()
