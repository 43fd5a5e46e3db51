"""MemoryConsumerRunner: drives a dedup handler from a MemoryBroker queue.

The reference runner: the adapters do the same translation with a real broker.
A twin of RabbitConsumerRunner and KafkaConsumerRunner: ``(handler, queue, *,
broker, config, before_ack)`` as theirs are ``(handler, queue, *, url, config,
before_ack)`` and ``(handler, topics, *, bootstrap_servers, group_id, config,
before_ack)``, with a ``MemoryConfig`` in their field names.
"""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Callable, Sequence
from typing import Any, overload

from ..dedup.processing import BlockingProcessor, Handler
from ..lifecycle import BeforeAck, ConsumerRunner, DeadlinePassed
from ..options import duration, instance, maybe, text
from ..outcome import Outcome, Result
from .memory_broker import Delivery, MemoryBroker
from .memory_config import MemoryConfig

_names = itertools.count(1)
_CONFIG = "a MemoryConfig or None"
_RETRY_MEMORY = 10_000
_OLD_KEYWORDS = frozenset({"source", "batch_size", "retry_delay", "poll_interval", "name"})


def _old_form(
    broker: MemoryBroker,
    source: str,
    handler: Handler,
    *,
    batch_size: int = 1,
    retry_delay: float = 0.05,
    poll_interval: float = 0.05,
    name: str | None = None,
    before_ack: BeforeAck | None = None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of the 0.1 call form in the new one, its defaults and timing kept
    (a fixed ``retry_delay``: the longest wait is the first)."""
    # This form documented both in seconds: taken as such, checked as every duration is.
    delay = duration(retry_delay, "MemoryConsumerRunner(retry_delay)", seconds=True, zero=True)
    config = MemoryConfig(
        batch_size=batch_size,
        poll_timeout=duration(poll_interval, "MemoryConsumerRunner(poll_interval)", seconds=True),
        retry_delay=delay,
        max_retry_delay=delay,
        connection_name=name,
    )
    return (handler, source), {"broker": broker, "config": config, "before_ack": before_ack}


def _accepting_the_old_form(init: Callable[..., None]) -> Callable[..., None]:
    """``MemoryConsumerRunner(broker, source, handler, batch_size=.., retry_delay=<seconds>)``
    still works, with a DeprecationWarning; inspect and help() show the new signature."""

    @functools.wraps(init)
    def accepting(self: MemoryConsumerRunner, *args: Any, **kwargs: Any) -> None:
        if (args and isinstance(args[0], MemoryBroker)) or _OLD_KEYWORDS & kwargs.keys():
            warnings.warn(
                "MemoryConsumerRunner(broker, source, handler, batch_size=..., "
                "retry_delay=<seconds>) is deprecated: use MemoryConsumerRunner(handler, "
                "queue, broker=broker, config=MemoryConfig(batch_size=..., "
                "retry_delay=timedelta(...)))",
                DeprecationWarning,
                2,
            )
            args, kwargs = _old_form(*args, **kwargs)
        init(self, *args, **kwargs)

    return accepting


class MemoryConsumerRunner(ConsumerRunner):
    """Fetch up to ``batch_size`` messages of ``queue``, run them in one transaction, then
    settle each.

    ``handler`` is what ``@dedup.handler`` returned, of a Deduplicator or an
    AsyncDeduplicator (run on an event loop of the runner's own).

    PROCESSED and DUPLICATE are acked; FAILED is dead-lettered to
    ``<queue>.dlq`` with its reason, then acked; RETRY is given back to the
    broker after ``retry_delay`` (doubled per RETRY of the same message in a
    row, up to ``max_retry_delay``), to the front of the queue.
    """

    @overload
    def __init__(
        self,
        handler: Handler,
        queue: str,
        *,
        broker: MemoryBroker,
        config: MemoryConfig | None = None,
        before_ack: BeforeAck | None = None,
    ) -> None: ...

    @overload
    def __init__(
        self,
        broker: MemoryBroker,
        source: str,
        handler: Handler,
        *,
        batch_size: int = 1,
        retry_delay: float = 0.05,
        poll_interval: float = 0.05,
        name: str | None = None,
        before_ack: BeforeAck | None = None,
    ) -> None: ...

    @_accepting_the_old_form
    def __init__(
        self,
        handler: Handler,
        queue: str,
        *,
        broker: MemoryBroker,
        config: MemoryConfig | None = None,
        before_ack: BeforeAck | None = None,
    ) -> None:
        super().__init__(before_ack=before_ack)
        self.broker = instance(
            broker, "MemoryConsumerRunner.broker", MemoryBroker, "a MemoryBroker"
        )
        self.queue = text(queue, "MemoryConsumerRunner.queue")
        self.handler = handler
        self.processor = BlockingProcessor(handler)
        self._use_breaker(self.processor.breaker)
        config = maybe(config, "MemoryConsumerRunner.config", instance, MemoryConfig, _CONFIG)
        self.config = config = config if config is not None else MemoryConfig()
        self.name = config.connection_name or f"memory-consumer-{next(_names)}"
        self._retries: dict[str | None, int] = {}  # RETRYs in a row per id, for the backoff

    def run(self, *, until_idle: bool = False) -> None:
        """Consume until stop(), or with ``until_idle`` until the queue is empty.

        However it ends (stopped, or dead from SimulatedCrash or KeyboardInterrupt),
        the broker gets back what this runner held unacked, as RabbitMQ does when a
        consumer's connection closes and Kafka when a group member leaves.
        """
        try:
            # A missing table or right stops it here; a database away is waited for.
            if not self.start_checked(self.processor.check_startup):
                return
            self._set_ready(True)  # a queue is consumed from the first fetch: no subscribing
            self._consume(until_idle)
            self.breaker.raise_if_open()  # it stopped taking messages: CircuitOpen
        except DeadlinePassed as passed:
            self.gave_up(passed)
        finally:
            self._set_ready(False)
            self.broker.disconnect(self.name)
            self.processor.close()

    def _consume(self, until_idle: bool) -> None:
        while not self.stopping:
            self.tick()
            wait = 0.0 if until_idle else self.config.poll_timeout.total_seconds()
            deliveries = self.broker.fetch(
                self.queue, self.config.batch_size, consumer=self.name, timeout=wait
            )
            if not deliveries:
                if until_idle:
                    return
                continue
            results = self.processor.process([(d.to_message(), None) for d in deliveries])
            self._settle(deliveries, results)

    def _settle(self, deliveries: Sequence[Delivery], results: Sequence[Result]) -> None:
        self.committed(results)
        retries = []
        for delivery, result in zip(deliveries, results, strict=True):
            if result.outcome is Outcome.RETRY:
                retries.append(delivery)
                continue
            self._retries.pop(delivery.message_id, None)
            if result.outcome is Outcome.FAILED:
                reason = result.reason or "failed"
                self.broker.dead_letter(delivery, reason, self.processor.consumer)
            self.broker.ack(delivery)
        if retries:
            self.pause(self._backoff(retries))
            for delivery in reversed(retries):
                self.broker.nack(delivery)

    def _backoff(self, retries: Sequence[Delivery]) -> float:
        """The longest wait of ``retries``, each by its RETRYs in a row."""
        backoff, wait = self.config.redelivery_backoff, 0.0
        for delivery in retries:
            key = delivery.message_id
            count = self._retries[key] = self._retries.pop(key, 0) + 1
            wait = max(wait, backoff.delay(count))
        while len(self._retries) > _RETRY_MEMORY:
            del self._retries[next(iter(self._retries))]
        return wait
