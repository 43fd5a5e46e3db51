"""RabbitConsumerRunner: a queue's deliveries through a dedup handler, acked after the commit."""

from __future__ import annotations

import copy
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import pika.exceptions  # type: ignore[import-untyped]

from consumerdedup import ConfigurationError, Message, Outcome
from consumerdedup.dedup.processing import BlockingProcessor, Handler
from consumerdedup.headers import CONSUMER_HEADER, REASON_HEADER, SOURCE_HEADER
from consumerdedup.lifecycle import BeforeAck, ConsumerRunner
from consumerdedup.reasons import REASON_LIMIT

from .config import DEFAULT_URL, MAX_NAME_BYTES, RabbitConfig
from .connection import close_quietly, connect, frame_max, header_frame_size, parameters
from .convert import BODY_DROPPED_HEADER, Delivery, dead_letter_properties, to_message
from .errors import PublishFailed, PublishNacked, PublishRefused, TopologyError, Unroutable
from .publisher import channel_closed

log = logging.getLogger("consumerdedup.rabbitmq")

POLL = 0.1
"""Longest wait on the socket, so stop() from another thread or a signal is seen quickly."""
_LOST = (pika.exceptions.AMQPConnectionError, pika.exceptions.AMQPChannelError)
_RETRY_MEMORY = 10_000
_names = itertools.count(1)


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
        if not isinstance(queue, str) or not 0 < len(queue.encode()) <= MAX_NAME_BYTES:
            raise ConfigurationError(
                f"queue must be a non-empty str of {MAX_NAME_BYTES} bytes at most"
            )
        self.handler = handler
        self.processor = BlockingProcessor(handler)
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
        self._retries: dict[str, int] = {}  # consecutive RETRYs per id, for the backoff
        self._progress = False  # something was acked on the current connection
        self._dead_letters: Any = None  # the publishing channel of the current connection

    def run(self, *, until_idle: bool = False) -> None:
        """Consume until stop() (or SIGTERM/SIGINT after ``on_signals()``).

        With ``until_idle``, return once no delivery came for ``idle_timeout``
        and the queue has nothing ready: for tests, scripts and draining.
        """
        try:
            self.processor.check_startup()  # a missing table or right stops it here
            self._run(until_idle)
        finally:
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
            self._declare(connection.channel())
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
        channel = self._open(connection, buffer)
        self._dead_letters = None
        idle = self.config.idle_timeout.total_seconds()
        idle_since = time.monotonic()
        while not self.stopping:
            if len(buffer) < self.config.batch_size:
                connection.process_data_events(time_limit=0 if buffer else POLL)
            if self._cancelled:  # reconnect, and learn why on the way (a deleted queue: 404)
                raise pika.exceptions.ConsumerCancelled(f"the broker cancelled {self.queue!r}")
            if buffer:
                size = min(len(buffer), self.config.batch_size)
                self._handle(connection, channel, [buffer.popleft() for _ in range(size)])
                idle_since = time.monotonic()
            elif until_idle and time.monotonic() - idle_since >= idle:
                if self._ready(channel) == 0:
                    return
                idle_since = time.monotonic()

    def _open(self, connection: Any, buffer: deque[Delivery]) -> Any:
        """Channel, topology, qos, confirms and the consumer; a refusal here is not retried."""

        def deliver(_channel: Any, method: Any, properties: Any, body: bytes) -> None:
            buffer.append(Delivery(method, properties, body))

        def cancelled(_frame: Any) -> None:
            self._cancelled = True

        self._cancelled = False
        channel = connection.channel()
        try:
            if self.config.declare:
                self._declare(channel)
            channel.basic_qos(prefetch_count=self.config.prefetch)
            channel.confirm_delivery()  # dead letters are confirmed before the original's ack
            channel.add_on_cancel_callback(cancelled)
            channel.basic_consume(self.queue, deliver, auto_ack=False)
        except pika.exceptions.ChannelClosedByBroker as exc:
            raise TopologyError(f"cannot consume {self.queue!r}: {exc.reply_text}") from exc
        log.info("%s consuming %r (prefetch %d)", self.name, self.queue, self.config.prefetch)
        return channel

    def _declare(self, channel: Any) -> None:
        exchange, dlq = self.config.dead_letter_exchange, self.dead_letter_queue
        if exchange:
            channel.exchange_declare(exchange, exchange_type="direct", durable=True)
        channel.queue_declare(dlq, durable=True)
        if exchange:
            channel.queue_bind(dlq, exchange, routing_key=dlq)
        arguments = {
            "x-dead-letter-exchange": exchange,
            "x-dead-letter-routing-key": dlq,
            **self.config.queue_arguments,
        }
        channel.queue_declare(self.queue, durable=True, arguments=arguments)

    def _ready(self, channel: Any) -> int:
        return int(channel.queue_declare(self.queue, passive=True).method.message_count)

    def _handle(self, connection: Any, channel: Any, batch: Sequence[Delivery]) -> None:
        converted = [to_message(delivery, self.queue, self.config) for delivery in batch]
        results = self.processor.process(converted)
        self.committed(results)  # the before_ack hook: a SimulatedCrash leaves all unacked
        retry: list[tuple[Delivery, Message]] = []
        for delivery, (message, _), result in zip(batch, converted, results, strict=True):
            if result.outcome is Outcome.FAILED:
                if not self._dead_letter(connection, delivery, result.reason or "failed"):
                    retry.append((delivery, message))
            elif result.outcome is Outcome.RETRY:
                retry.append((delivery, message))
            else:
                self._retries.pop(str(message.id), None)
        if not retry:
            channel.basic_ack(batch[-1].tag, multiple=len(batch) > 1)
            self._progress = True
            return
        held = {delivery.tag for delivery, _ in retry}
        for delivery in batch:
            if delivery.tag not in held:
                channel.basic_ack(delivery.tag)
                self._progress = True
        self._wait(connection, self._backoff([message for _, message in retry]))
        for delivery, _ in retry:
            channel.basic_nack(delivery.tag, requeue=True)

    def _dead_letter(self, connection: Any, delivery: Delivery, reason: str) -> bool:
        """Publish a copy with the reason to the dead-letter queue; True once it is confirmed,
        or once it can never be: a refusal for good (over the broker's max_message_size, no
        access, properties over the frame size) must not hold the queue, so a copy without the
        body goes, then a bare one (no original header either); if that is refused too the
        loss is logged at ERROR (the FAILED record is kept). False for a failure that may pass
        (no DLQ or exchange yet, a nack): the message backs off.

        On a channel of its own: a refused publish closes that channel only, so the
        consuming channel keeps its deliveries and can still ack the batch-mates.
        """
        properties = dead_letter_properties(delivery, reason, self.processor.consumer, self.queue)
        body, refused = delivery.body, list[PublishFailed]()
        for copy_number in range(3):
            if copy_number:
                properties = copy.copy(properties)
                kept = properties.headers if copy_number == 1 else _ours(properties.headers)
                properties.headers = {**kept, BODY_DROPPED_HEADER: str(refused[0])[:REASON_LIMIT]}
                body = b""
            error = self._publish_dead_letter(connection, body, properties)
            if error is None:
                if refused:
                    log.error(
                        "dead-lettered a message of %r to %r without its body%s, which was "
                        "refused: %s",
                        self.queue,
                        self.dead_letter_queue,
                        "" if copy_number == 1 else " and headers",
                        refused[0],
                    )
                return True
            if not isinstance(error, PublishRefused):
                self._log_unsent(error)
                return False
            refused.append(error)
        log.error(
            "cannot dead-letter a message of %r to %r, not even without its body (%s): it is "
            "not dead-lettered, its FAILED record is kept",
            self.queue,
            self.dead_letter_queue,
            "; then ".join(str(e) for e in refused),
        )
        return True

    def _publish_dead_letter(
        self, connection: Any, body: bytes, properties: Any
    ) -> PublishFailed | None:
        """Publish and wait for the confirm; the failure, if any, as one of our errors."""
        exchange = self.config.dead_letter_exchange
        if header_frame_size(properties) > frame_max(connection, self._params):
            # The broker would close the whole connection (501 FRAME_ERROR), and the message
            # would come back after the reconnect, again and again.
            return PublishRefused("the copy's properties and headers exceed the frame size")
        try:
            if self._dead_letters is None or not self._dead_letters.is_open:
                self._dead_letters = connection.channel()
                self._dead_letters.confirm_delivery()
            self._dead_letters.basic_publish(
                exchange, self.dead_letter_queue, body, properties, mandatory=True
            )
        except pika.exceptions.UnroutableError:
            return Unroutable(f"no dead-letter queue {self.dead_letter_queue!r} is bound")
        except pika.exceptions.NackError:
            return PublishNacked(f"the broker refused a dead letter to {exchange!r}")
        except pika.exceptions.ChannelClosedByBroker as exc:
            return channel_closed(exc, exchange)
        return None

    def _log_unsent(self, error: PublishFailed) -> None:
        log.error(
            "cannot dead-letter a message of %r (%s); it stays in the queue for redelivery "
            "(RabbitConfig(declare=True) declares a missing dead-letter queue or exchange)",
            self.queue,
            error,
        )

    def _backoff(self, messages: Sequence[Message]) -> float:
        """The longest wait of ``messages``, each by its RETRYs in a row."""
        backoff = self.config.redelivery_backoff
        wait = 0.0
        for message in messages:
            key = str(message.id)
            count = self._retries[key] = self._retries.pop(key, 0) + 1
            wait = max(wait, backoff.delay(count))
        while len(self._retries) > _RETRY_MEMORY:
            del self._retries[next(iter(self._retries))]
        return wait

    def _wait(self, connection: Any, seconds: float) -> None:
        """Sleep while answering heartbeats; stop() cuts it short."""
        deadline = time.monotonic() + seconds
        while not self.stopping and (left := deadline - time.monotonic()) > 0:
            connection.process_data_events(time_limit=min(left, POLL))


_OURS = (REASON_HEADER, CONSUMER_HEADER, SOURCE_HEADER)


def _ours(headers: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in headers.items() if name in _OURS}
