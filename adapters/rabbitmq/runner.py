"""RabbitConsumerRunner: a queue's deliveries through a dedup handler, acked after the commit."""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import pika.exceptions  # type: ignore[import-untyped]

from consumerdedup import Message, Outcome, collector, options
from consumerdedup.dedup.processing import BlockingProcessor, Handler
from consumerdedup.lifecycle import BeforeAck, ConsumerRunner, DeadlinePassed

from . import acks, retry_later, subscription
from .config import DEFAULT_URL, MAX_NAME_BYTES, RabbitConfig
from .connection import close_quietly, connect, losses_handled, parameters
from .convert import Delivery, to_message
from .dead_letters import DeadLetters
from .errors import TopologyError
from .retry_later import POLL, RetrySchedule

log = logging.getLogger("consumerdedup.rabbitmq")

_LOST = (pika.exceptions.AMQPConnectionError, pika.exceptions.AMQPChannelError)
_names = itertools.count(1)
_ACKED = frozenset((Outcome.PROCESSED, Outcome.DUPLICATE))
"""Outcomes settled by the ack alone (FAILED is dead-lettered first, RETRY requeued)."""


class RabbitConsumerRunner(ConsumerRunner):
    """Consume ``queue`` with manual acks; each batch runs in one transaction, then is settled.

    PROCESSED and DUPLICATE are acked (a clean batch with one ``multiple`` ack);
    FAILED is published to the dead-letter queue with its reason, confirmed,
    then acked; RETRY is nacked with requeue after a backoff. A lost connection
    or channel is reopened with backoff; what was unacked comes back and the
    dedup table answers it.

    ``handler`` is what ``@dedup.handler`` returned, of a Deduplicator or an
    AsyncDeduplicator (run on an event loop of the runner's own). A delivery
    without a usable id is refused before the pipeline: FAILED, dead-lettered.
    """

    def __init__(
        self,
        handler: Handler,
        queue: str,
        *,
        url: str = DEFAULT_URL,
        config: RabbitConfig | None = None,
        before_ack: BeforeAck | None = None,
    ) -> None:
        super().__init__(before_ack=before_ack)
        options.text(queue, "RabbitConsumerRunner.queue")
        if len(queue.encode()) > MAX_NAME_BYTES:
            raise options.refuse(
                "RabbitConsumerRunner.queue", queue, f"{MAX_NAME_BYTES} bytes at most"
            )
        options.text(url, "RabbitConsumerRunner.url", secret=True)
        config = options.maybe(
            config,
            "RabbitConsumerRunner.config",
            options.instance,
            RabbitConfig,
            "a RabbitConfig or None",
        )
        self.handler = handler
        self.processor = BlockingProcessor(handler)
        self._use_breaker(self.processor.breaker)
        self.queue = queue
        self.config = config = config or RabbitConfig()
        self.dead_letter_queue = config.dead_letters_of(queue)
        consumer = self.processor.consumer
        self.name = config.connection_name or (
            f"consumerdedup:{consumer}:{queue}:{os.getpid()}:{next(_names)}"
        )
        self._params = parameters(url, config.connection_options, self.name)
        self.reconnects = 0
        self._cancelled = False
        self._schedule = RetrySchedule(config.redelivery_backoff)
        self._progress = False  # something was acked on the current connection
        self._dead_letters = DeadLetters(config, queue, consumer, self._params)

    def run(self, *, until_idle: bool = False) -> None:
        """Consume until stop() (or SIGTERM/SIGINT after ``on_signals()``).

        With ``until_idle``, return once no delivery came for ``idle_timeout``
        and the queue has nothing ready: for tests, scripts and draining.
        """
        try:
            # A missing table or right stops it here; a database away is waited for.
            if not self.start_checked(self.processor.check_startup):
                return
            with losses_handled():  # a lost connection: our one line, not pika's burst
                self._run(until_idle)
            self.breaker.raise_if_open()  # it stopped taking messages: CircuitOpen
        except DeadlinePassed as passed:  # its connection closed: the broker requeues
            self.gave_up(passed)
        finally:
            self._set_ready(False)
            self.processor.close()

    def _run(self, until_idle: bool) -> None:
        failures = 0  # lost connections in a row without progress: the backoff grows with them
        while not self.stopping:
            connection = self._connect()
            if connection is None:
                return
            self._progress = False
            try:
                self._consume(connection, until_idle)
                return
            except _LOST as exc:
                self._set_ready(False)  # until consuming again
                self.reconnects += 1
                failures = 1 if self._progress else failures + 1
                wait = self.config.reconnect_backoff.delay(failures)
                log.warning(
                    "%s lost its RabbitMQ connection (%r); reconnecting in %.1fs",
                    self.name,
                    exc,
                    wait,
                )
            finally:
                close_quietly(connection)  # also after SimulatedCrash: the broker requeues
            self.pause(wait)

    def declare(self) -> None:
        """Declare the queue, its dead-letter queue and exchange now (idempotent), whatever
        ``config.declare`` says: for deploy scripts, and to publish before consuming."""
        connection = self._connect()
        if connection is None:  # stop() came first
            return
        try:
            subscription.declare(connection.channel(), self.queue, self.config)
        except pika.exceptions.ChannelClosedByBroker as exc:
            raise TopologyError(f"cannot declare {self.queue!r}: {exc.reply_text}") from exc
        finally:
            close_quietly(connection)

    def _connect(self) -> Any:
        return connect(
            self._params,
            backoff=self.config.reconnect_backoff,
            give_up_after=self.config.reconnect_timeout,
            stopping=lambda: self.stopping,
            pause=self.pause,
        )

    def _consume(self, connection: Any, until_idle: bool) -> None:
        buffer: deque[Delivery] = deque()
        channel = self._subscribe(connection, buffer)
        self._dead_letters.reconnected()
        idle = self.config.idle_timeout.total_seconds()
        idle_since = time.monotonic()
        while not self.stopping:
            self.tick()
            if len(buffer) < self.config.batch_size:
                connection.process_data_events(time_limit=0 if buffer else POLL)
            if self._cancelled:  # reconnect, and learn why on the way (a deleted queue: 404)
                raise pika.exceptions.ConsumerCancelled(f"the broker cancelled {self.queue!r}")
            if buffer:
                size = min(len(buffer), self.config.batch_size)
                self._handle(connection, channel, [buffer.popleft() for _ in range(size)])
                idle_since = time.monotonic()
            elif until_idle and time.monotonic() - idle_since >= idle:
                if subscription.ready(channel, self.queue) == 0:
                    return
                idle_since = time.monotonic()

    def _turn(self) -> bool:
        """A turn of a wait that answers heartbeats: the loop is alive; True to stop."""
        self.tick()
        return self.stopping

    def _subscribe(self, connection: Any, buffer: deque[Delivery]) -> Any:
        def cancelled() -> None:
            self._cancelled = True

        self._cancelled = False
        channel = subscription.subscribe(
            connection, self.queue, self.config, buffer.append, cancelled
        )
        log.info("%s consuming %r (prefetch %d)", self.name, self.queue, self.config.prefetch)
        self._set_ready(True)
        collector.freeze_once()  # set up: the collector stops walking it (collector.py)
        return channel

    def _handle(self, connection: Any, channel: Any, batch: Sequence[Delivery]) -> None:
        converted = [to_message(delivery, self.queue, self.config) for delivery in batch]
        results = self.processor.process(converted)
        self.committed(results)  # the before_ack hook: a SimulatedCrash leaves all unacked
        if self._schedule.empty and all(r.outcome in _ACKED for r in results):
            # The usual batch: all acked, and no RETRY remembered that settling would forget.
            acks.ack_all(channel, batch)
            self._progress = True
            return
        retry: list[tuple[Delivery, Message]] = []
        for delivery, (message, _), result in zip(batch, converted, results, strict=True):
            if result.outcome is Outcome.FAILED:
                if not self._dead_letters.send(connection, delivery, result.reason or "failed"):
                    retry.append((delivery, message))
            elif result.outcome is Outcome.RETRY:
                retry.append((delivery, message))
            else:
                self._schedule.settled(message)
        if not retry:
            acks.ack_all(channel, batch)
            self._progress = True
            return
        held = {delivery.tag for delivery, _ in retry}
        self._progress |= acks.ack_decided(channel, batch, held)
        delay = self._schedule.delay(message for _, message in retry)
        retry_later.wait(connection, delay, self._turn)
        acks.requeue(channel, [delivery for delivery, _ in retry])
