"""aiokafka producers that behave as a broker Tansu cannot stand in for would.

``NoAutoCreate``: a cluster that does not create topics on demand.

Most production clusters run with ``auto.create.topics.enable=false``; Tansu
creates any topic a producer asks about, so the refusal cannot come from the
broker here. On such a cluster aiokafka waits ``request_timeout_ms`` for
metadata of the unknown topic, then raises UnknownTopicOrPartitionError (or
the send times out with KafkaTimeoutError). ``NoAutoCreate`` raises that same
aiokafka error at once for a topic the broker does not list, and sends
everything else for real. Install it with ``no_auto_create(monkeypatch)``, which also makes
the publisher's topic check before a first send (a metadata request that may create the
topic, as a send would) ask without creating: the answer such a cluster gives.

``GrantsIdempotence``: a broker that grants idempotent producers (Tansu 0.6 refuses
InitProducerId, so there the default dead-letter producer cannot even start). It records
how it was built and what it was asked to send, and first raises, in order, the aiokafka
errors of its ``script``, as the broker would answer them. Install it with
``grants_idempotence(monkeypatch, script)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import UnknownTopicOrPartitionError
from aiokafka.protocol.metadata import MetadataRequest


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
    monkeypatch.setattr("consumerdedup.adapters.kafka.connection.AIOKafkaProducer", double)

    def never_creating(topics: list[str], allow_auto_topic_creation: bool) -> MetadataRequest:
        return MetadataRequest(topics, allow_auto_topic_creation=False)

    checks = "consumerdedup.adapters.kafka.publish_failures.MetadataRequest"
    monkeypatch.setattr(checks, never_creating, raising=False)
    return double


@dataclass
class Sent:
    topic: str
    value: bytes | None
    key: bytes | None
    headers: list[tuple[str, bytes]]


class GrantsIdempotence:
    built: ClassVar[list[dict[str, Any]]] = []
    sent: ClassVar[list[Sent]] = []
    script: ClassVar[list[tuple[str, Exception]]] = []
    """("start" or "send", the aiokafka error that step raises next), in order."""

    client: ClassVar[Any] = None
    """No metadata requests: the dead-letter topic check gets no answer, the send tells."""

    def __init__(self, **settings: Any) -> None:
        self.built.append(settings)

    def _scripted(self, step: str) -> None:
        if self.script and self.script[0][0] == step:
            raise self.script.pop(0)[1]

    async def start(self) -> None:
        self._scripted("start")

    async def stop(self) -> None:
        pass

    async def send_and_wait(
        self, topic: str, value: bytes | None, key: bytes | None = None, headers: Any = None
    ) -> Any:
        self._scripted("send")
        self.sent.append(Sent(topic, value, key, list(headers or [])))
        return None


def grants_idempotence(
    monkeypatch: pytest.MonkeyPatch, script: list[tuple[str, Exception]]
) -> type[GrantsIdempotence]:
    """Make KafkaPublisher (the dead-letter producer too) use GrantsIdempotence."""
    double = type(
        "GrantsIdempotence", (GrantsIdempotence,), {"built": [], "sent": [], "script": script}
    )
    monkeypatch.setattr("consumerdedup.adapters.kafka.connection.AIOKafkaProducer", double)
    return double
