"""KafkaPublisher passes the shared publisher contract, on a Kafka-protocol broker."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest

from consumerdedup import AsyncPublisher
from consumerdedup.adapters.kafka import KafkaPublisher
from consumerdedup.headers import ID_HEADER
from tests.contracts.publisher import PublisherCapabilities, PublisherContract, Received
from tests.support.kafka_doubles import no_auto_create
from tests.support.kafka_service import KafkaService, Topics, free_port, kafka_fixture  # noqa: F401

T = TypeVar("T")


class KafkaPublisherHarness:
    """Destinations are topics of three partitions; a consumer takes the ``event_id`` header
    as the id. The broker is made to refuse unknown topics (tests/support/kafka_doubles.py),
    as production clusters do: Tansu would create them."""

    capabilities = PublisherCapabilities(creates_destinations=False, can_be_away=True)

    def __init__(self, kafka: KafkaService) -> None:
        self.kafka = kafka
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.topics = Topics(kafka)

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def publisher(self) -> AsyncPublisher:
        return KafkaPublisher(self.kafka.bootstrap, enable_idempotence=self.kafka.idempotence)

    def unreachable(self) -> AsyncPublisher:
        return KafkaPublisher(f"127.0.0.1:{free_port()}", enable_idempotence=False)

    def destination(self) -> str:
        return self._call(self.topics.create("publisher", partitions=3))

    def missing(self) -> str:
        return f"cdd-missing-{uuid.uuid4().hex[:10]}"

    def received(self, destination: str) -> list[Received]:
        found = []
        for record in self._call(self.topics.records(destination)):
            headers = {name: value.decode() for name, value in record.headers}
            found.append(Received(headers.get(ID_HEADER), record.value, headers))
        return found

    def close(self) -> None:
        try:
            self._call(self.topics.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


class TestKafkaPublisher(PublisherContract):
    @pytest.fixture
    def harness(
        self, kafka: KafkaService, monkeypatch: pytest.MonkeyPatch
    ) -> Iterator[KafkaPublisherHarness]:
        no_auto_create(monkeypatch)
        harness = KafkaPublisherHarness(kafka)
        yield harness
        harness.close()
