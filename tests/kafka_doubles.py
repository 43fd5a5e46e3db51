"""An aiokafka producer that behaves as on a cluster that does not create topics on demand.

Most production clusters run with ``auto.create.topics.enable=false``; Tansu
creates any topic a producer asks about, so the refusal cannot come from the
broker here. On such a cluster aiokafka waits ``request_timeout_ms`` for
metadata of the unknown topic, then raises UnknownTopicOrPartitionError (or
the send times out with KafkaTimeoutError). ``NoAutoCreate`` raises that same
aiokafka error at once for a topic the broker does not list, and sends
everything else for real. Install it with ``no_auto_create(monkeypatch)``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import UnknownTopicOrPartitionError


class NoAutoCreate(AIOKafkaProducer):  # type: ignore[misc]
    error: ClassVar[type[Exception]] = UnknownTopicOrPartitionError
    refused: ClassVar[list[str]] = []
    """Topics refused, in order, by every instance."""

    async def send(self, topic: str, *args: Any, **kwargs: Any) -> Any:
        cluster = await self.client.fetch_all_metadata()  # lists topics, creates none
        if topic not in cluster.topics():
            self.refused.append(topic)
            raise self.error()
        return await super().send(topic, *args, **kwargs)


def no_auto_create(
    monkeypatch: pytest.MonkeyPatch, error: type[Exception] = UnknownTopicOrPartitionError
) -> type[NoAutoCreate]:
    """Make KafkaPublisher use NoAutoCreate, raising ``error`` for a missing topic."""
    double = type("NoAutoCreate", (NoAutoCreate,), {"error": error, "refused": []})
    monkeypatch.setattr("consumerdedup.adapters.kafka.publisher.AIOKafkaProducer", double)
    return double
