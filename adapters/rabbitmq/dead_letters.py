"""The dead-letter path: a FAILED delivery's copy, with its reason, to the dead-letter queue.

The copy goes on a channel of its own, with publisher confirms: a refused publish closes
that channel only, so the consuming channel keeps its deliveries and can still ack the
batch-mates. A refusal for good (over the broker's max_message_size, no access, properties
over the frame size) must not hold the queue, so a copy without the body goes, then a bare
one (no original header either); if that is refused too the loss is logged at ERROR and the
FAILED record is kept. A failure that may pass (a nack) leaves the delivery to back off and
come again. With ``RabbitConfig(declare=True)`` a DLQ or exchange found missing (deleted
while the runner runs) is declared again at once, not only at the next connect: else the
FAILED delivery would come back, unsent, until a reconnect.

A dead-letter exchange that does not exist, or no queue bound for the dead letters, that
the runner does not declare (or fails to declare again) is a setup fault: DeadLetterMissing
stops the runner, the delivery unacked. It used to be taken for "not there yet": the
delivery came back again and again, each time after a longer pause of the whole runner (up
to ``max_retry_delay``), and ``run(until_idle=True)`` never returned.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pika.exceptions  # type: ignore[import-untyped]

from consumerdedup.headers import CONSUMER_HEADER, REASON_HEADER, SOURCE_HEADER
from consumerdedup.reasons import REASON_LIMIT

from . import subscription
from .config import RabbitConfig
from .connection import frame_max, header_frame_size
from .convert import BODY_DROPPED_HEADER, Delivery, dead_letter_properties
from .errors import (
    DeadLetterMissing,
    ExchangeMissing,
    PublishFailed,
    PublishNacked,
    PublishRefused,
    Unroutable,
)
from .outgoing import channel_closed

log = logging.getLogger("consumerdedup.rabbitmq")
_OURS = (REASON_HEADER, CONSUMER_HEADER, SOURCE_HEADER)


class DeadLetters:
    """Publishes a queue's FAILED deliveries to its dead-letter queue, one connection at a
    time: ``reconnected`` drops the channel of the connection before."""

    def __init__(self, config: RabbitConfig, queue: str, consumer: str, params: Any) -> None:
        self.config = config
        self.queue = queue
        self.dead_letter_queue = config.dead_letters_of(queue)
        self.consumer = consumer
        self._params = params
        self._channel: Any = None  # the publishing channel of the current connection

    def reconnected(self) -> None:
        self._channel = None

    def send(self, connection: Any, delivery: Delivery, reason: str) -> bool:
        """True once the copy is confirmed, or can never be; False for a failure that may
        pass (see the module's docstring)."""
        properties = dead_letter_properties(delivery, reason, self.consumer, self.queue)
        body, refused = delivery.body, list[PublishFailed]()
        for copy_number in range(3):
            if copy_number:
                properties = copy.copy(properties)
                kept = properties.headers if copy_number == 1 else _ours(properties.headers)
                properties.headers = {**kept, BODY_DROPPED_HEADER: str(refused[0])[:REASON_LIMIT]}
                body = b""
            error = self._publish(connection, body, properties)
            if isinstance(error, Unroutable | ExchangeMissing):
                declared = self._declare(connection)
                if declared:
                    error = self._publish(connection, body, properties)
                if isinstance(error, Unroutable | ExchangeMissing):
                    raise self._missing(error, declared)
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

    def _publish(self, connection: Any, body: bytes, properties: Any) -> PublishFailed | None:
        """Publish and wait for the confirm; the failure, if any, as one of our errors."""
        exchange = self.config.dead_letter_exchange
        if header_frame_size(properties) > frame_max(connection, self._params):
            # The broker would close the whole connection (501 FRAME_ERROR), and the message
            # would come back after the reconnect, again and again.
            return PublishRefused("the copy's properties and headers exceed the frame size")
        try:
            if self._channel is None or not self._channel.is_open:
                self._channel = connection.channel()
                self._channel.confirm_delivery()
            self._channel.basic_publish(
                exchange, self.dead_letter_queue, body, properties, mandatory=True
            )
        except pika.exceptions.UnroutableError:
            return Unroutable(f"no dead-letter queue {self.dead_letter_queue!r} is bound")
        except pika.exceptions.NackError:
            return PublishNacked(f"the broker refused a dead letter to {exchange!r}")
        except pika.exceptions.ChannelClosedByBroker as exc:
            return channel_closed(exc, exchange)
        return None

    def _declare(self, connection: Any) -> bool:
        """With ``config.declare``: the topology declared again, on a channel of its own (a
        404 closed the publishing one); True if it was."""
        if not self.config.declare:
            return False
        channel = connection.channel()
        try:
            subscription.declare(channel, self.queue, self.config)
        except pika.exceptions.ChannelClosedByBroker as exc:
            log.error(
                "cannot declare the dead-letter queue %r again: %s", self.dead_letter_queue, exc
            )
            return False
        log.warning("declared the dead-letter queue %r again: it was gone", self.dead_letter_queue)
        channel.close()
        return True

    def _missing(self, error: PublishFailed, declared: bool) -> DeadLetterMissing:
        """The setup fault for a dead letter with nowhere to go, naming what to fix."""
        exchange, dlq = self.config.dead_letter_exchange, self.dead_letter_queue
        if isinstance(error, ExchangeMissing):
            what = f"the dead-letter exchange {exchange!r} does not exist"
            fix = f"declare it and bind the queue {dlq!r} to it with routing key {dlq!r}"
        else:
            through = f"exchange {exchange!r}" if exchange else "the default exchange"
            what = f"no queue is bound for its dead letters ({through}, routing key {dlq!r})"
            fix = f"declare the dead-letter queue {dlq!r}"
            fix += f" and bind it to {exchange!r}" if exchange else ""
        if not self.config.declare:
            fix += ", or set RabbitConfig(declare=True)"
        elif declared:  # declared, yet the copy still has nowhere to go
            fix += " (RabbitConfig(declare=True) declared it again, to no avail)"
        else:
            fix += " (declaring it again failed: see the line before)"
        return DeadLetterMissing(
            f"cannot dead-letter a message of {self.queue!r}: {what} ({error}). To fix: {fix}; "
            "then restart the runner. The message stays in the queue, unacked, its FAILED "
            "record kept: it is dead-lettered when it comes again"
        )

    def _log_unsent(self, error: PublishFailed) -> None:
        log.error(
            "cannot dead-letter a message of %r (%s); it stays in the queue for redelivery",
            self.queue,
            error,
        )


def _ours(headers: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in headers.items() if name in _OURS}
