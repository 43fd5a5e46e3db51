"""MemoryConsumerRunner: drives a dedup handler from a MemoryBroker queue.

The reference runner: the adapters do the same translation with a real broker.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from ..dedup.driving import BlockingDriver, Handler
from ..lifecycle import BeforeAck, ConsumerRunner
from ..outcome import Outcome, Result
from .memory_broker import Delivery, MemoryBroker

_names = itertools.count(1)


class MemoryConsumerRunner(ConsumerRunner):
    """Fetch up to ``batch_size`` messages, run them in one transaction, then settle each.

    ``handler`` is what ``@dedup.handler`` returned, of a Deduplicator or an
    AsyncDeduplicator (run on an event loop of the runner's own).

    PROCESSED and DUPLICATE are acked; FAILED is dead-lettered to
    ``<source>.dlq`` with its reason, then acked; RETRY is given back to the
    broker after ``retry_delay`` seconds.
    """

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
    ) -> None:
        super().__init__(before_ack=before_ack)
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.broker = broker
        self.source = source
        self.handler = handler
        self.driver = BlockingDriver(handler)
        self.batch_size = batch_size
        self.retry_delay = retry_delay
        self.poll_interval = poll_interval
        self.name = name or f"memory-consumer-{next(_names)}"

    def run(self, *, until_idle: bool = False) -> None:
        """Consume until stop(), or with ``until_idle`` until the source is empty.

        However it ends (stopped, or dead from SimulatedCrash or KeyboardInterrupt),
        the broker gets back what this runner held unacked, as RabbitMQ does when a
        consumer's connection closes and Kafka when a group member leaves.
        """
        try:
            self._consume(until_idle)
        finally:
            self.broker.disconnect(self.name)
            self.driver.close()

    def _consume(self, until_idle: bool) -> None:
        while not self.stopping:
            wait = 0.0 if until_idle else self.poll_interval
            deliveries = self.broker.fetch(
                self.source, self.batch_size, consumer=self.name, timeout=wait
            )
            if not deliveries:
                if until_idle:
                    return
                continue
            results = self.driver.process([(d.to_message(), None) for d in deliveries])
            self._settle(deliveries, results)

    def _settle(self, deliveries: Sequence[Delivery], results: Sequence[Result]) -> None:
        self.committed(results)
        retries = []
        for delivery, result in zip(deliveries, results, strict=True):
            if result.outcome is Outcome.RETRY:
                retries.append(delivery)
                continue
            if result.outcome is Outcome.FAILED:
                reason = result.reason or "failed"
                self.broker.dead_letter(delivery, reason, self.driver.consumer)
            self.broker.ack(delivery)
        if retries:
            self.pause(self.retry_delay)
            for delivery in reversed(retries):
                self.broker.nack(delivery)
