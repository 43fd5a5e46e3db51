"""KafkaPublisher: acks=all, keys and headers; what the outbox relay and dead letters use."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

from aiokafka.errors import (  # type: ignore[import-untyped]
    KafkaError,
    KafkaTimeoutError,
    NoError,
    UnknownTopicOrPartitionError,
)

from consumerdedup.options import boolean, mapping, maybe
from consumerdedup.outbox.publisher import AsyncPublisher, NotSent, Outgoing
from consumerdedup.reasons import describe

from . import connection
from .config import DEFAULT_BOOTSTRAP, PRODUCER_OPTIONS
from .connection import producer_settings
from .errors import BrokerUnavailable, PublishFailed, PublishRefused, TopicMissing, TopicRefused
from .publish_failures import PRODUCER_STATE, start_failure, topic_answer, topic_refusal

Headers = Mapping[str, str | bytes] | Sequence[tuple[str, bytes]]
_KNOWN = "an AIOKafkaProducer argument"
TOPIC_LIST_TIMEOUT = 10.0
"""Seconds the broker has to list its topics when a send failed in a way that may mean
either "no such topic" or "no broker"."""


class KafkaPublisher(AsyncPublisher):
    """An aiokafka producer with ``acks="all"``; ``destination`` is the topic.

    ``enable_idempotence`` (default on) keeps a producer's own retries from
    writing a record twice; brokers without InitProducerId (Tansu) need it off.
    ``options`` are passed to ``AIOKafkaProducer`` (``linger_ms``, security...).
    Started on first use, or with ``start()`` / ``async with``; ``stop()`` flushes.

    Before the first send to a topic the broker is asked about it (as a send would,
    letting it create the topic): one it does not have and will not create raises
    TopicMissing at once, one whose name it refuses TopicRefused (a PublishRefused),
    without aiokafka's 40 s wait. A topic missing later (deleted) and a broker that
    does not answer are reported by aiokafka the same way, after ``request_timeout_ms``:
    the broker's topic list tells them apart (TopicMissing, BrokerUnavailable). Once a
    topic is known to be missing, later sends to it ask that list first and fail at once
    until the topic appears.
    """

    def __init__(
        self,
        bootstrap_servers: str | Sequence[str] = DEFAULT_BOOTSTRAP,
        *,
        enable_idempotence: bool = True,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        connection.check_bootstrap(bootstrap_servers)
        idempotent = boolean(enable_idempotence, "KafkaPublisher.enable_idempotence")
        passed = maybe(
            options, "KafkaPublisher.options", mapping, allowed=PRODUCER_OPTIONS, allowed_are=_KNOWN
        )
        self._settings = producer_settings(bootstrap_servers, idempotent, passed or {})
        self._producer: Any = None
        self._starting = asyncio.Lock()
        self._missing: set[str] = set()
        self._known: set[str] = set()  # topics the broker said it has

    async def start(self) -> None:
        async with self._starting:
            if self._producer is not None:
                return
            producer = connection.producer(self._settings)
            try:
                await producer.start()
            except BaseException as exc:
                await producer.stop()
                where = self._settings["bootstrap_servers"]
                if isinstance(exc, KafkaError) and (
                    sasl := await connection.sasl_refusal(where, self._settings)
                ):
                    raise connection.authentication_failed(sasl, where) from exc
                if isinstance(exc, KafkaError):
                    # Raised from start() too, also through ``async with`` (the outbox
                    # relay enters the publisher before its first send): a broker that
                    # does not answer must read as BrokerUnavailable there as well.
                    raise start_failure(exc, self._settings) from exc
                raise
            self._producer = producer

    @property
    def client(self) -> Any:
        """The started producer's aiokafka client (metadata requests), or None."""
        return None if self._producer is None else self._producer.client

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

    async def publish_window(self, messages: Sequence[Outgoing]) -> list[BaseException | None]:
        """Send every message, then gather their acknowledgements (acks=all).

        aiokafka sends one request at a time per broker and mutes a partition while its
        batch is in flight (retries included), so its own retries cannot reorder a
        partition: same-key messages land in window order. A failed send is that message's
        outcome, told apart as ``send`` does (the broker away, the topic missing, a
        refusal), asked once per topic and kind of error.
        """
        if self._producer is None:
            await self.start()
        pending: list[Any] = []
        refused: dict[str, BaseException] = {}  # topics found missing or refused in this window
        asked: set[str] = set()  # topics asked about in this window
        failed_keys: set[str] = set()  # failed before sending: their later messages wait
        failed = False  # an outcome known before the gather (rare): wrapped below
        send = self._producer.send
        for topic, body, key, headers in messages:  # once per event: no call it need not
            if key is not None and key in failed_keys:
                pending.append(NotSent())
                failed = True
                continue
            try:
                if topic in refused:
                    raise refused[topic]
                if topic in self._missing:
                    await self._refuse_if_still_missing(topic)
                elif topic not in self._known and topic not in asked:
                    asked.add(topic)
                    await self._check_topic(topic)
                pending.append(
                    await send(
                        topic,
                        body,
                        key=key.encode() if type(key) is str else _bytes(key),
                        headers=_header_list(headers),
                    )
                )
            except (TopicMissing, TopicRefused, KafkaError) as exc:
                if isinstance(exc, TopicMissing | TopicRefused):
                    refused[topic] = exc
                pending.append(exc)
                failed = True
                if key is not None:
                    failed_keys.add(key)
        if failed:
            pending = [_done(p) if isinstance(p, BaseException) else p for p in pending]
        results = await asyncio.gather(*pending, return_exceptions=True)
        told: dict[tuple[str, type], BaseException] = {}
        outcomes: list[BaseException | None] = []
        for message, result in zip(messages, results, strict=True):
            if not isinstance(result, BaseException):
                outcomes.append(None)
            elif isinstance(result, KafkaError):
                kind = (message.destination, type(result))
                if kind not in told:
                    told[kind] = await self._failure(message.destination, result)
                outcomes.append(told[kind])
            else:
                outcomes.append(result)
        return outcomes

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
            if topic in self._missing:
                await self._refuse_if_still_missing(topic)
            elif topic not in self._known:
                await self._check_topic(topic)
            return await self._producer.send_and_wait(
                topic, value, key=_bytes(key), headers=_header_list(headers)
            )
        except KafkaError as exc:
            raise await self._failure(topic, exc) from exc

    async def _failure(self, topic: str, exc: KafkaError) -> PublishFailed:
        """The error to raise for ``exc``: the broker away, the topic missing, or a refusal."""
        reason = f"cannot publish to {topic!r}: {describe(exc)}"
        if isinstance(exc, PRODUCER_STATE):
            with contextlib.suppress(Exception):  # a broken producer may not stop politely
                await self.stop()  # the next send starts a new producer
            self._producer = None
            return PublishFailed(reason)
        # Retriable errors and timeouts mean "not now"; the others "never, for this record".
        if not (getattr(exc, "retriable", False) or isinstance(exc, KafkaTimeoutError)):
            return PublishRefused(reason)
        if isinstance(exc, UnknownTopicOrPartitionError | KafkaTimeoutError):
            found = await self._topics()
            if found is not None and topic not in found:
                self._missing.add(topic)
                return TopicMissing(f"{reason}: topic {topic!r} does not exist")
        return BrokerUnavailable(reason)

    async def _check_topic(self, topic: str) -> None:
        """Before the first send to ``topic``: TopicMissing or TopicRefused at once if the
        broker says so (see ``topic_answer``); any other answer, or none, lets the send try."""
        answer = await topic_answer(self.client, topic)
        refusal = topic_refusal(topic, answer)
        if refusal is None:
            if answer is NoError:
                self._known.add(topic)
            return
        if isinstance(refusal, TopicMissing):
            self._missing.add(topic)
        raise refusal

    async def _refuse_if_still_missing(self, topic: str) -> None:
        found = await self._topics()
        if found is not None and topic not in found:
            raise TopicMissing(f"cannot publish to {topic!r}: topic {topic!r} does not exist")
        self._missing.discard(topic)  # created since, or no answer: a real send will tell

    async def _topics(self) -> set[str] | None:
        """Every topic the broker has (a request that creates none); None if nobody answers."""
        if self._producer is None:
            return None
        try:
            listing = self._producer.client.fetch_all_metadata()
            cluster = await asyncio.wait_for(listing, TOPIC_LIST_TIMEOUT)
        except (KafkaError, TimeoutError, OSError):
            return None
        return set(cluster.topics(exclude_internal_topics=False))


async def _done(error: BaseException) -> None:
    """An outcome known before the gather, raised inside it."""
    raise error


def _bytes(value: str | bytes | None) -> bytes | None:
    return value.encode() if isinstance(value, str) else value


def _header_list(headers: Headers | None) -> list[tuple[str, bytes]]:
    if type(headers) is dict:  # the relay's (a row's JSON): no ABC check per event
        return [(name, _bytes(value) or b"") for name, value in headers.items()]
    if headers is None:
        return []
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    return [(name, _bytes(value) or b"") for name, value in pairs]
