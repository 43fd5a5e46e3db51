"""The subscription: the queue's topology, and a consuming channel with qos.

The consuming channel only consumes and settles: dead letters go on a channel of their own
(dead_letters.py), in confirm mode there, so this one is not put in confirm mode (a round
trip at every connect, for nothing).

A refusal here (a queue declared with other arguments, no access) is a TopologyError,
not retried. The broker's cancel (the queue deleted) is reported through ``on_cancel``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pika.exceptions  # type: ignore[import-untyped]

from .config import TTL_ARGUMENT, RabbitConfig
from .convert import Delivery
from .errors import TopologyError

log = logging.getLogger("consumerdedup.rabbitmq")


def declare(channel: Any, queue: str, config: RabbitConfig) -> None:
    """The queue, its dead-letter queue and exchange (idempotent)."""
    exchange, dlq = config.dead_letter_exchange, config.dead_letters_of(queue)
    if exchange:
        channel.exchange_declare(exchange, exchange_type="direct", durable=True)
    channel.queue_declare(dlq, durable=True)
    if exchange:
        channel.queue_bind(dlq, exchange, routing_key=dlq)
    arguments = {
        "x-dead-letter-exchange": exchange,
        "x-dead-letter-routing-key": dlq,
        **config.queue_arguments,
    }
    if config.message_ttl is not None:  # also the window prune --rabbitmq reads (retention.py)
        arguments[TTL_ARGUMENT] = config.message_ttl // timedelta(milliseconds=1)
    channel.queue_declare(queue, durable=True, arguments=arguments)


def subscribe(
    connection: Any,
    queue: str,
    config: RabbitConfig,
    deliver: Callable[[Delivery], None],
    on_cancel: Callable[[], None],
) -> Any:
    """A channel consuming ``queue`` with manual acks, each delivery handed to ``deliver``."""

    def delivered(_channel: Any, method: Any, properties: Any, body: bytes) -> None:
        deliver(Delivery(method, properties, body))

    channel = connection.channel()
    try:
        if config.declare:
            declare(channel, queue, config)
        channel.basic_qos(prefetch_count=config.prefetch)
        channel.add_on_cancel_callback(lambda _frame: on_cancel())
        channel.basic_consume(queue, delivered, auto_ack=False)
    except pika.exceptions.ChannelClosedByBroker as exc:
        missing = exc.reply_code == 404 and not config.declare
        fix = "; declare it, or set RabbitConfig(declare=True)" if missing else ""
        raise TopologyError(f"cannot consume {queue!r}: {exc.reply_text}{fix}") from exc
    return channel


def ready(channel: Any, queue: str) -> int:
    """How many messages ``queue`` holds ready for delivery."""
    return int(channel.queue_declare(queue, passive=True).method.message_count)
