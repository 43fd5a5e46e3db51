"""An in-process broker with at-least-once delivery, for unit tests and the demo.

It behaves like a queue broker with manual acks: a fetched message stays
with the broker, unacked, until it is acked; a consumer that dies (or is
made to die between commit and ack) gets its unacked messages redelivered.
It can also deliver duplicates on purpose, as real brokers do after a
rebalance or a lost ack.
"""

from __future__ import annotations

import itertools
import random
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from ..errors import SimulatedCrash
from ..headers import CONSUMER_HEADER, DEAD_LETTER_SUFFIX, ID_HEADER, REASON_HEADER
from ..message import Message
from ..options import integer, number, refuse
from ..outbox.publisher import Publisher

__all__ = ["CONSUMER_HEADER", "REASON_HEADER", "Delivery", "MemoryBroker"]


@dataclass(frozen=True)
class Delivery:
    """One handing-out of a stored message; ``tag`` is unique per handing-out."""

    tag: int
    source: str
    message_id: str | None
    body: bytes
    headers: Mapping[str, str]
    offset: int
    redelivered: bool
    consumer: str

    def to_message(self) -> Message:
        return Message(
            id=self.message_id,
            body=self.body,
            headers=self.headers,
            source=self.source,
            partition=0,
            offset=self.offset,
            timestamp=datetime.now(UTC),
            raw=self,
        )


@dataclass
class _Stored:
    offset: int
    message_id: str | None
    body: bytes
    headers: dict[str, str]
    deliveries: int = 0


@dataclass
class _Queue:
    ready: deque[_Stored] = field(default_factory=deque)
    unacked: dict[int, tuple[str, _Stored]] = field(default_factory=dict)
    offsets: itertools.count[int] = field(default_factory=itertools.count)


class MemoryBroker(Publisher):
    """Queues by name; FIFO; acks by delivery tag; thread-safe.

    ``duplicate_rate`` is the chance that an acked message is delivered once
    more (seeded, so runs repeat).
    """

    def __init__(self, *, duplicate_rate: float = 0.0, seed: int = 0) -> None:
        rate = number(duplicate_rate, "MemoryBroker.duplicate_rate", at_least=0)
        if rate >= 1:
            raise refuse("MemoryBroker.duplicate_rate", duplicate_rate, "a number in [0, 1)")
        self.duplicate_rate = rate
        integer(seed, "MemoryBroker.seed")
        self._random = random.Random(seed)
        self._queues: dict[str, _Queue] = {}
        self._tags = itertools.count(1)
        self._lock = threading.Condition()
        self._crashes: list[Callable[[Delivery], bool]] = []
        self.published = self.delivered = self.redelivered = self.acked = 0
        self.duplicates_injected = self.crashes_injected = 0

    # Producing

    def publish(
        self,
        destination: str,
        body: bytes,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
        *,
        message_id: str | None = None,
    ) -> None:
        """Store a message; its id comes from ``message_id`` or the ``event_id`` header."""
        merged = dict(headers or {})
        if message_id is not None:
            merged[ID_HEADER] = message_id
        with self._lock:
            queue = self._queue(destination)
            queue.ready.append(_Stored(next(queue.offsets), merged.get(ID_HEADER), body, merged))
            self.published += 1
            self._lock.notify_all()

    # Consuming

    def fetch(
        self, source: str, max_messages: int = 1, *, consumer: str = "consumer", timeout: float = 0
    ) -> list[Delivery]:
        """Hand out up to ``max_messages``; they stay unacked until ack, nack or a crash."""
        with self._lock:
            queue = self._queue(source)
            if not queue.ready and timeout > 0:
                self._lock.wait_for(lambda: bool(queue.ready), timeout)
            out: list[Delivery] = []
            while queue.ready and len(out) < max_messages:
                stored = queue.ready.popleft()
                stored.deliveries += 1
                tag = next(self._tags)
                queue.unacked[tag] = (consumer, stored)
                self.delivered += 1
                self.redelivered += stored.deliveries > 1
                out.append(
                    Delivery(
                        tag,
                        source,
                        stored.message_id,
                        stored.body,
                        dict(stored.headers),
                        stored.offset,
                        stored.deliveries > 1,
                        consumer,
                    )
                )
            return out

    def ack(self, delivery: Delivery) -> None:
        """Settle a delivery. An injected crash fires here: after the commit, before the ack."""
        with self._lock:
            for crash in self._crashes:
                if crash(delivery):
                    self._crashes.remove(crash)
                    self.crashes_injected += 1
                    self._requeue_consumer(delivery.consumer)
                    raise SimulatedCrash(f"injected crash before acking {delivery.message_id!r}")
            queue = self._queue(delivery.source)
            _, stored = queue.unacked.pop(delivery.tag)
            self.acked += 1
            if self.duplicate_rate and self._random.random() < self.duplicate_rate:
                queue.ready.append(stored)  # delivered again later, as after a lost ack
                self.duplicates_injected += 1
                self._lock.notify_all()

    def nack(self, delivery: Delivery) -> None:
        """Give a delivery back; it goes to the front so the source's order holds."""
        with self._lock:
            queue = self._queue(delivery.source)
            _, stored = queue.unacked.pop(delivery.tag)
            queue.ready.appendleft(stored)
            self._lock.notify_all()

    def dead_letter(self, delivery: Delivery, reason: str, consumer: str = "") -> None:
        """Copy a delivery to ``<source>.dlq`` with the reason in a header (the caller acks)."""
        headers = {**delivery.headers, REASON_HEADER: reason, CONSUMER_HEADER: consumer}
        self.publish(delivery.source + DEAD_LETTER_SUFFIX, delivery.body, headers=headers)

    # Fault injection

    def crash_before_ack(self, when: Callable[[Delivery], bool] | None = None) -> None:
        """Make the next matching ack kill its consumer: all its unacked messages come back."""
        with self._lock:
            self._crashes.append(when or (lambda delivery: True))

    def crash(self, consumer: str) -> None:
        """A consumer died: everything it held unacked is delivered again."""
        self.disconnect(consumer)

    def disconnect(self, consumer: str) -> None:
        """A consumer went away (stopped or died): what it held unacked is delivered again."""
        with self._lock:
            self._requeue_consumer(consumer)

    def _requeue_consumer(self, consumer: str) -> None:
        for queue in self._queues.values():
            held = sorted(
                (stored for owner, stored in queue.unacked.values() if owner == consumer),
                key=lambda stored: stored.offset,
                reverse=True,
            )
            queue.unacked = {t: v for t, v in queue.unacked.items() if v[0] != consumer}
            queue.ready.extendleft(held)
        self._lock.notify_all()

    # Inspection

    def held(self, source: str) -> int:
        """Messages the broker still holds for ``source``: ready plus unacked."""
        with self._lock:
            queue = self._queue(source)
            return len(queue.ready) + len(queue.unacked)

    def messages(self, source: str) -> list[Message]:
        """What is ready in ``source`` (a dead-letter queue, say), without consuming it."""
        with self._lock:
            return [
                Message(s.message_id, s.body, s.headers, source, 0, s.offset)
                for s in self._queue(source).ready
            ]

    def _queue(self, name: str) -> _Queue:
        return self._queues.setdefault(name, _Queue())
