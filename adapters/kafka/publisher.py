"""KafkaPublisher: acks=all, keys and headers; what the outbox relay and dead letters use."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

from aiokafka import AIOKafkaProducer  # type: ignore[import-untyped]
from aiokafka.errors import KafkaError, KafkaTimeoutError  # type: ignore[import-untyped]

from consumerdedup.errors import describe

from .config import DEFAULT_BOOTSTRAP, PUBLISHER_OWNED, reject_owned
from .errors import BrokerUnavailable, PublishFailed

Headers = Mapping[str, str | bytes] | Sequence[tuple[str, bytes]]


class KafkaPublisher:
    """An aiokafka producer with ``acks="all"``; ``destination`` is the topic.

    ``enable_idempotence`` (default on) keeps a producer's own retries from
    writing a record twice; brokers without InitProducerId (Tansu) need it off.
    ``options`` are passed to ``AIOKafkaProducer`` (``linger_ms``, security...).
    Started on first use, or with ``start()`` / ``async with``; ``stop()`` flushes.
    """

    def __init__(
        self,
        bootstrap_servers: str | Sequence[str] = DEFAULT_BOOTSTRAP,
        *,
        enable_idempotence: bool = True,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        options = dict(options or {})
        reject_owned("options", options, PUBLISHER_OWNED)
        self._settings = {
            **options,
            "bootstrap_servers": bootstrap_servers,
            "acks": "all",
            "enable_idempotence": enable_idempotence,
        }
        self._producer: Any = None
        self._starting = asyncio.Lock()

    async def start(self) -> None:
        async with self._starting:
            if self._producer is not None:
                return
            producer = AIOKafkaProducer(**self._settings)
            try:
                await producer.start()
            except BaseException:
                await producer.stop()
                raise
            self._producer = producer

    async def stop(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            await producer.stop()

    async def __aenter__(self) -> KafkaPublisher:
        await self.start()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def publish(
        self,
        destination: str,
        body: bytes,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Send to topic ``destination``; returns once every in-sync replica has it."""
        await self.send(destination, body, key=key, headers=headers)

    async def send(
        self,
        topic: str,
        value: bytes | None,
        *,
        key: str | bytes | None = None,
        headers: Headers | None = None,
    ) -> Any:
        """Like ``publish``, also for null values and raw headers; returns the RecordMetadata."""
        try:
            if self._producer is None:
                await self.start()
            return await self._producer.send_and_wait(
                topic, value, key=_bytes(key), headers=_header_list(headers)
            )
        except KafkaError as exc:
            # Retriable errors and timeouts mean "not now", not "never": the relay waits.
            transient = getattr(exc, "retriable", False) or isinstance(exc, KafkaTimeoutError)
            error = BrokerUnavailable if transient else PublishFailed
            raise error(f"cannot publish to {topic!r}: {describe(exc)}") from exc


def _bytes(value: str | bytes | None) -> bytes | None:
    return value.encode() if isinstance(value, str) else value


def _header_list(headers: Headers | None) -> list[tuple[str, bytes]]:
    if headers is None:
        return []
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    return [(name, _bytes(value) or b"") for name, value in pairs]
