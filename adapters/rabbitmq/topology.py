"""A queue's topology without a runner: declare it, or find which queues are missing.

``declare`` is what ``RabbitConsumerRunner.declare()`` does (the queue with its
dead-letter arguments, the dead-letter queue and exchange), for deploy scripts and
``App.check()``, without a handler; ``missing_queues`` asks with passive declares.

Only 404 NOT_FOUND on a passive declare means the queue is missing. Any other channel
close (405 RESOURCE_LOCKED: exclusive to another connection; 403 ACCESS_REFUSED where
a broker checks rights) says nothing of its existence: ``refused`` makes it a RabbitError
naming the queue, the reply and the fix, never a "missing" answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pika  # type: ignore[import-untyped]
import pika.exceptions  # type: ignore[import-untyped]

from . import subscription
from .config import DEFAULT_URL, RabbitConfig
from .connection import close_quietly, parameters
from .errors import RabbitError, TopologyError

NOT_FOUND = 404


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
    params = parameters(url, connection_options or {}, "consumerdedup:check")
    connection = pika.BlockingConnection(params)
    try:
        missing: list[str] = []
        channel = connection.channel()
        for queue in queues:
            try:
                channel.queue_declare(queue, passive=True)
            except pika.exceptions.ChannelClosedByBroker as exc:
                if exc.reply_code != NOT_FOUND:
                    raise refused(queue, params, exc) from exc
                missing.append(queue)
                channel = connection.channel()  # the broker closed that one
        return missing
    finally:
        close_quietly(connection)


def refused(queue: str, params: Any, exc: Any) -> RabbitError:
    """The broker closed the channel on a passive declare of ``queue`` with ``exc``'s reply,
    not 404: an error saying so, with the fix for that reply code."""
    vhost, user = params.virtual_host, params.credentials.username
    code, text = exc.reply_code, exc.reply_text
    if code == 403:
        fix = (
            f"grant user {user!r} rights on the queue in vhost {vhost!r} "
            f"(rabbitmqctl set_permissions -p {vhost} {user} CONFIGURE WRITE READ)"
        )
    elif code == 405:
        fix = "the queue is exclusive to another connection: name a queue that is not exclusive"
    else:
        fix = "see the broker's log for the reason"
    return RabbitError(
        f"RabbitMQ refused a passive declare of queue {queue!r} in vhost {vhost!r} as user "
        f"{user!r} ({code} {text}): the queue may exist, it was not found missing; {fix}"
    )
