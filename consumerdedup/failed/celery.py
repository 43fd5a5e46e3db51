"""Replay the dead letters of Celery tasks (consumerdedup.celery.IdempotentTask): forget
their FAILED records, send each task message back to the queue it came from, ack it off
``<queue>.dlq`` only after the broker took the copy.

The broker is the Celery app's own (``--celery-app module:app``: its ``broker_url`` and
transport options; nothing stores the broker's address), through kombu, so RabbitMQ and
Redis brokers alike. The copy is the dead letter's own bytes (the task's name, id and
arguments as its serializer wrote them), without the ``x-dead-letter-*`` headers, sent to
the source queue as Celery routes a direct queue (the default exchange, the queue's name
as routing key; ``to``: that queue instead). Killed at any point nothing is lost, as in
consumerdedup.failed.rabbitmq: a letter not acked goes back to the DLQ (kombu restores
an unacked Redis message when its channel closes), and one sent but not acked is sent
twice, the second answered DUPLICATE by the dedup record.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from kombu.exceptions import ChannelError
from sqlalchemy import Engine

from ..errors import ConfigurationError
from ..headers import CELERY_TASK_HEADER, CONSUMER_HEADER, ID_HEADER, REASON_HEADER, SOURCE_HEADER
from ..schema import DEFAULT, Tables
from .queue_replay import replay_rounds, text
from .report import DeadLetter, ReplayReport
from .selection import Selection

__all__ = ["load_celery_app", "replay", "waiting"]

# kombu is untyped: reached as Any, as the adapters are.
_kombu: Any = importlib.import_module("kombu")

_OURS = (REASON_HEADER, CONSUMER_HEADER, SOURCE_HEADER, CELERY_TASK_HEADER)
_PASSED_ON = ("correlation_id", "reply_to", "priority")


def load_celery_app(target: str) -> Any:
    """The Celery app ``module:attribute`` names (the current directory first on the
    path, as ``celery -A`` does); ConfigurationError saying what is wrong."""
    module_name, colon, attribute = target.partition(":")
    if not colon or not module_name or not attribute:
        raise ConfigurationError(
            f"--celery-app {target!r}: expected MODULE:ATTRIBUTE, the module and the Celery "
            "app in it, e.g. proj.celery:app"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        found: Any = importlib.import_module(module_name)
        for name in attribute.split("."):
            found = getattr(found, name)
    except (ImportError, AttributeError) as error:
        raise ConfigurationError(f"--celery-app {target!r}: {error}") from None
    celery: Any = importlib.import_module("celery")
    if not isinstance(found, celery.Celery):
        raise ConfigurationError(
            f"--celery-app {target!r} is a {type(found).__name__}, not a Celery app"
        )
    return found


def replay(
    engine: Engine,
    app: Any,
    dead_letter_queue: str,
    *,
    tables: Tables = DEFAULT,
    limit: int | None = None,
    to: str | None = None,
    id_header: str = ID_HEADER,
    dry_run: bool = False,
    on_confirmed: Callable[[DeadLetter], Any] | None = None,
    selection: Selection | None = None,
) -> ReplayReport:
    """consumerdedup.failed.rabbitmq.replay's contract, for the dead letters IdempotentTask
    sent to ``dead_letter_queue`` on ``app``'s broker."""
    selection = selection or Selection()
    report = ReplayReport(dead_letter_queue)
    # confirm_publish: py-amqp waits for RabbitMQ's confirm (Redis's LPUSH answers anyway)
    todo = waiting(app, dead_letter_queue)  # on a channel of its own: a 404 closes it
    if todo == 0:
        return report
    with app.connection_for_write(transport_options={"confirm_publish": True}) as connection:
        channel = connection.channel()
        try:
            letters = _Letters(app, channel, dead_letter_queue, id_header, to)
            replay_rounds(
                engine,
                tables,
                letters,
                todo,
                report,
                limit=limit,
                selection=selection,
                dry_run=dry_run,
                on_confirmed=on_confirmed,
            )
        finally:
            channel.close()
    return report


def waiting(app: Any, dead_letter_queue: str) -> int:
    """How many dead letters ``dead_letter_queue`` holds now on ``app``'s broker."""
    with app.connection_for_write() as connection:
        return _count(connection.channel(), dead_letter_queue)


def _count(channel: Any, queue: str) -> int:
    """The queue's length; 0 when the broker has no such queue (Redis keeps no empty list:
    an emptied DLQ is gone)."""
    try:
        return int(channel.queue_declare(queue, passive=True).message_count)
    except ChannelError:
        return 0
    except Exception as exc:  # py-amqp's NotFound (404) is not kombu's ChannelError
        if getattr(exc, "code", None) == 404 or getattr(exc, "reply_code", None) == 404:
            return 0
        raise


class _Letters:
    """The DLQ through kombu: a letter is held as its kombu message, acked off the DLQ
    after its copy went out, requeued to give it back."""

    def __init__(self, app: Any, channel: Any, queue: str, id_header: str, to: str | None):
        self.app, self.queue, self.id_header, self.to = app, queue, id_header, to
        self.channel = channel
        self.producer = _kombu.Producer(channel)

    def take(self, count: int) -> list[tuple[Any, DeadLetter]]:
        batch: list[tuple[Any, DeadLetter]] = []
        bound = _kombu.Queue(self.queue, no_declare=True)(self.channel)
        for _ in range(count):
            message = bound.get(no_ack=False)
            if message is None:
                break
            headers = message.headers or {}
            letter = DeadLetter(
                consumer=text(headers.get(CONSUMER_HEADER)),
                message_id=text(headers.get(self.id_header) or headers.get("id")),
                source=text(headers.get(SOURCE_HEADER)),
                reason=text(headers.get(REASON_HEADER)),
            )
            batch.append((message, letter))
        return batch

    def unreplayable(self, message: Any, letter: DeadLetter) -> str | None:
        if not self.to and not letter.source:
            return f"no {SOURCE_HEADER} header: pass --to QUEUE"
        if letter.consumer is None:
            return f"no {CONSUMER_HEADER} header: its record cannot be forgotten"
        if letter.message_id is None:
            return "no task id: its record cannot be found"
        return None

    def vetted(self, batch: Any, verdicts: list[str | None]) -> list[str | None]:
        return verdicts  # a missing queue is declared on send, as Celery declares it

    def send(self, message: Any, letter: DeadLetter) -> None:
        """The dead letter's own bytes to its queue, declared as Celery declares it."""
        queue = self.to or str(letter.source)
        headers = {k: v for k, v in (message.headers or {}).items() if k not in _OURS}
        properties = dict(message.properties or {})
        properties.pop("delivery_info", None)
        properties.pop("delivery_tag", None)
        properties.pop("body_encoding", None)
        properties.pop("application_headers", None)
        self.producer.publish(
            message.body,
            exchange="",
            routing_key=queue,
            declare=[self.app.amqp.queues[queue]],
            headers=headers,
            content_type=message.content_type,
            content_encoding=message.content_encoding,
            retry=True,
            **{k: v for k, v in properties.items() if k in _PASSED_ON},
        )

    def ack(self, message: Any) -> None:
        message.ack()

    def give_back(self, message: Any) -> None:
        message.requeue()
