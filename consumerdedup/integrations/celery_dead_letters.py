"""A FAILED Celery task's dead letter: the task message, as Celery itself would send it,
published to ``<queue>.dlq`` on the task's own broker, for ``consumerdedup failed replay
--celery-app module:app`` to send back.

What is kept and where (decided for safety): the task's name, id, arguments and
keyword arguments, serialized by the task's own serializer, exactly as the broker held
them before; no copy goes to consumerdedup's tables, to a log or to the CLI's output
(which prints the task's name and id only). Nothing is scrubbed: a scrubbed copy could not
be replayed, and the copy stays on the broker that already carried it. Celery's
``argsrepr``/``kwargsrepr`` (what monitors show instead of the arguments) are kept. The
broker's address is not stored anywhere: the replay reads it from the Celery app it is
given. ``retries`` starts again at 0, so the replayed task has its full retry budget.
The ``x-dead-letter-*`` headers are the runners' (consumer, source queue, reason) plus
the task's name; the dedup key travels in ``event_id`` (a ``key=`` function's key is not
the task id).
"""

from __future__ import annotations

import importlib
from typing import Any

from ..headers import (
    CELERY_TASK_HEADER,
    CONSUMER_HEADER,
    DEAD_LETTER_SUFFIX,
    ID_HEADER,
    REASON_HEADER,
    SOURCE_HEADER,
)
from ..outcome import Result

__all__ = ["dead_letter_queue", "send_dead_letter", "source_of"]

# kombu is untyped: reached as Any.
_kombu: Any = importlib.import_module("kombu")


def source_of(request: Any, default_queue: str) -> str:
    """The queue the task came through: Celery sends to a direct queue through the default
    exchange with the queue's name as the routing key."""
    info = request.delivery_info or {}
    return str(info.get("routing_key") or default_queue)


def dead_letter_queue(source: str) -> Any:
    """``<source>.dlq``, as kombu declares it on any transport (a direct exchange of its own
    name; Celery publishes to it through the default exchange)."""
    name = source + DEAD_LETTER_SUFFIX
    return _kombu.Queue(name, _kombu.Exchange(name, type="direct"), routing_key=name, durable=True)


def send_dead_letter(
    task: Any, args: tuple[Any, ...], kwargs: dict[str, Any], consumer: str, result: Result
) -> None:
    """Publish the running task's dead letter (the Deduplicator's ``dead_letter`` hook: if
    this raises, the task is not acked and comes back, to be dead-lettered again)."""
    app, request = task.app, task.request
    source = source_of(request, app.conf.task_default_queue)
    message = app.amqp.create_task_message(
        request.id,
        task.name,
        args,
        kwargs,
        retries=0,
        group_id=request.group,
        group_index=request.group_index,
        chord=request.chord,
        callbacks=request.callbacks,
        errbacks=request.errbacks,
        chain=request.chain,
        root_id=request.root_id,
        parent_id=request.parent_id,
        shadow=request.shadow,
        argsrepr=getattr(request, "argsrepr", None),
        kwargsrepr=getattr(request, "kwargsrepr", None),
        ignore_result=task.ignore_result,
    )
    ours = {
        CONSUMER_HEADER: consumer,
        SOURCE_HEADER: source,
        REASON_HEADER: result.reason or "",
        CELERY_TASK_HEADER: task.name,
    }
    if result.message.id is not None:  # a task its key function refused has none: the task id
        ours[ID_HEADER] = str(result.message.id)
    with app.producer_or_acquire() as producer:
        app.amqp.send_task_message(
            producer,
            task.name,
            message,
            queue=dead_letter_queue(source),
            headers=ours,
            serializer=task.serializer,
        )
