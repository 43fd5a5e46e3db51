"""A queue's topology without a runner: declare it, or find which queues are missing.

``declare`` is what ``RabbitConsumerRunner.declare()`` does (the queue with its
dead-letter arguments, the dead-letter queue and exchange), for deploy scripts and
``App.check()``, without a handler; ``missing_queues`` asks with passive declares.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pika  # type: ignore[import-untyped]
import pika.exceptions  # type: ignore[import-untyped]

from . import subscription
from .config import DEFAULT_URL, RabbitConfig
from .connection import close_quietly, parameters
from .errors import TopologyError


def declare(queue: str, *, url: str = DEFAULT_URL, config: RabbitConfig | None = None) -> None:
    """Declare ``queue``, its dead-letter queue and exchange now (idempotent)."""
    config = config or RabbitConfig()
    connection = pika.BlockingConnection(
        parameters(url, config.connection_options, f"consumerdedup:declare:{queue}")
    )
    try:
        subscription.declare(connection.channel(), queue, config)
    except pika.exceptions.ChannelClosedByBroker as exc:
        raise TopologyError(f"cannot declare {queue!r}: {exc.reply_text}") from exc
    finally:
        close_quietly(connection)


def missing_queues(
    queues: Sequence[str],
    *,
    url: str = DEFAULT_URL,
    connection_options: Mapping[str, Any] | None = None,
) -> list[str]:
    """The queues of ``queues`` that do not exist (passive declares), in the order given."""
    connection = pika.BlockingConnection(
        parameters(url, connection_options or {}, "consumerdedup:check")
    )
    try:
        missing: list[str] = []
        channel = connection.channel()
        for queue in queues:
            try:
                channel.queue_declare(queue, passive=True)
            except pika.exceptions.ChannelClosedByBroker as exc:
                if exc.reply_code != 404:
                    raise
                missing.append(queue)
                channel = connection.channel()  # the broker closed that one
        return missing
    finally:
        close_quietly(connection)
