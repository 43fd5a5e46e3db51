"""Replay a RabbitMQ dead-letter queue: forget the FAILED records, republish each dead letter
to the queue it came from, ack it off the DLQ only after the broker confirmed the copy.

A dead letter names its source queue and its consumer in the headers the runner set
(``x-dead-letter-source``, ``x-dead-letter-consumer``); its id is the ``message_id``
property or the id header, as the runner read it. Killed at any point, nothing is lost:
a dead letter not yet acked goes back to the DLQ, and one whose copy was confirmed but
not acked is replayed twice, which the dedup table answers (the second copy is a
DUPLICATE, or forget finds a completed record and leaves it). A message whose cause was
not fixed simply fails again and is dead-lettered again; the replay takes only the
dead letters present when it started, so it never chases those.
"""

from __future__ import annotations

import copy
import importlib
import os
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import pika  # type: ignore[import-untyped]
import pika.exceptions  # type: ignore[import-untyped]
from sqlalchemy import Engine

from .. import options
from ..errors import ConfigurationError
from ..headers import (
    CELERY_TASK_HEADER,
    CONSUMER_HEADER,
    ID_HEADER,
    REASON_HEADER,
    SOURCE_HEADER,
)
from ..retry import Backoff
from ..schema import DEFAULT, Tables
from .queue_replay import replay_rounds, text
from .report import DeadLetter, ReplayReport
from .selection import Selection

# The adapter installs as consumerdedup.adapters from adapters/ (not on mypy's path).
_adapter: Any = importlib.import_module("consumerdedup.adapters.rabbitmq")
_connection: Any = importlib.import_module("consumerdedup.adapters.rabbitmq.connection")

_OURS = (REASON_HEADER, CONSUMER_HEADER, SOURCE_HEADER)
_BROKERS = ("x-death", "x-first-death-", "x-last-death-")


def replay(
    engine: Engine,
    url: str,
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
    """Replay up to ``limit`` (None: all) of the dead letters now in ``dead_letter_queue``
    that ``selection`` takes (None: all) to their source queue (``to``: to that queue
    instead). The others stay in the DLQ, in their places. With ``dry_run`` nothing is
    forgotten, published or acked: every dead letter taken is given back. ``on_confirmed``
    is called after a copy is confirmed and before its dead letter is acked."""
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ConfigurationError(f"limit must be a positive int or None, got {limit!r}")
    selection = options.maybe(selection, "selection", options.instance, Selection, "a Selection")
    selection = selection or Selection()
    connection = open_connection(url)
    report = ReplayReport(dead_letter_queue)
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        try:
            todo = channel.queue_declare(dead_letter_queue, passive=True).method.message_count
        except pika.exceptions.ChannelClosedByBroker as exc:
            raise _adapter.TopologyError(
                f"cannot read {dead_letter_queue!r}: {exc.reply_text}"
            ) from exc
        letters = _Letters(connection, channel, dead_letter_queue, id_header, selection, to)
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
        _connection.close_quietly(connection)
    return report


Held = tuple[int, Any, bytes]
"""A letter taken: its delivery tag, properties and body."""


class _Letters:
    """The DLQ through pika: a letter is held as its delivery tag, properties and body,
    republished with confirms, acked after the confirm, nacked (requeue) to give it back."""

    def __init__(
        self,
        connection: Any,
        channel: Any,
        queue: str,
        id_header: str,
        selection: Selection,
        to: str | None,
    ) -> None:
        self.connection, self.channel, self.queue, self.to = connection, channel, queue, to
        self.id_header = id_header
        # the consumer of a letter the broker dead-lettered (it has no consumer header)
        self.consumer = selection.consumer

    def take(self, count: int) -> list[tuple[Held, DeadLetter]]:
        batch: list[tuple[Held, DeadLetter]] = []
        for _ in range(count):
            method, properties, body = self.channel.basic_get(self.queue, auto_ack=False)
            if method is None:
                break
            headers = properties.headers if isinstance(properties.headers, dict) else {}
            message_id = properties.message_id or headers.get(self.id_header)
            ours = CONSUMER_HEADER in headers
            letter = DeadLetter(
                consumer=text(headers.get(CONSUMER_HEADER)) if ours else self.consumer,
                message_id=text(message_id),
                source=text(headers.get(SOURCE_HEADER)) if ours else _death_queue(headers),
                reason=text(headers.get(REASON_HEADER)),
            )
            batch.append(((method.delivery_tag, properties, body), letter))
        return batch

    def unreplayable(self, held: Held, letter: DeadLetter) -> str | None:
        _, properties, _ = held
        headers = properties.headers if isinstance(properties.headers, dict) else {}
        if CELERY_TASK_HEADER in headers:
            return "a Celery task's dead letter: replay it with --celery-app module:app"
        if _adapter.BODY_DROPPED_HEADER in headers:
            return "dead-lettered without its body (the broker refused the full copy)"
        if not self.to and not letter.source:
            return f"no {SOURCE_HEADER} header: pass --to QUEUE"
        if letter.consumer is None:
            return (
                f"no {CONSUMER_HEADER} header (dead-lettered by the broker, as a FastStream "
                "subscriber's are): pass --consumer NAME, the consumer whose records to forget"
            )
        if letter.message_id is None:
            return "no message id (message_id property or id header): its record cannot be found"
        return None

    def vetted(
        self, batch: Sequence[tuple[Held, DeadLetter]], verdicts: list[str | None]
    ) -> list[str | None]:
        """A source queue deleted since, found before the forget: such a letter stays in
        the DLQ with its FAILED record still listed."""
        targets = [self.to or str(letter.source) for _, letter in batch]
        gone = _missing_queues(
            self.connection, {q for q, why in zip(targets, verdicts, strict=True) if why is None}
        )
        return [
            f"no queue {q!r} to return to" if why is None and q in gone else why
            for q, why in zip(targets, verdicts, strict=True)
        ]

    def send(self, held: Held, letter: DeadLetter) -> str | None:
        """Publish the original properties back to the queue and wait for the confirm; why
        not, if the broker did not confirm it."""
        _, properties, body = held
        queue = self.to or str(letter.source)
        original = copy.copy(properties)
        headers = properties.headers if isinstance(properties.headers, dict) else {}
        original.headers = {
            k: v for k, v in headers.items() if k not in _OURS and not k.startswith(_BROKERS)
        }
        try:
            self.channel.basic_publish("", queue, body, original, mandatory=True)
        except pika.exceptions.UnroutableError:
            return f"no queue {queue!r} to return to"
        except pika.exceptions.NackError:
            return f"the broker refused the copy to {queue!r}"
        return None

    def ack(self, held: Held) -> None:
        self.channel.basic_ack(held[0])

    def give_back(self, held: Held) -> None:
        self.channel.basic_nack(held[0], requeue=True)


def _death_queue(headers: dict[str, Any]) -> str | None:
    """The queue RabbitMQ dead-lettered the message from (its first death)."""
    first = headers.get("x-first-death-queue")
    if first is not None:
        return text(first)
    deaths = headers.get("x-death")
    if isinstance(deaths, list) and deaths and isinstance(deaths[-1], dict):
        return text(deaths[-1].get("queue"))
    return None


def _missing_queues(connection: Any, queues: set[str]) -> set[str]:
    """Which of ``queues`` the broker does not have (a passive declare answered 404), asked
    on a channel of its own: the broker closes a channel on each 404."""
    missing: set[str] = set()
    channel = None
    try:
        for queue in sorted(queues):
            if channel is None or not channel.is_open:
                channel = connection.channel()
            try:
                channel.queue_declare(queue, passive=True)
            except pika.exceptions.ChannelClosedByBroker as exc:
                if exc.reply_code != 404:
                    raise
                missing.add(queue)
    finally:
        if channel is not None and channel.is_open:
            channel.close()
    return missing


def waiting(url: str, dead_letter_queue: str) -> int:
    """How many dead letters ``dead_letter_queue`` holds now."""
    connection = open_connection(url)
    try:
        try:
            declared = connection.channel().queue_declare(dead_letter_queue, passive=True)
        except pika.exceptions.ChannelClosedByBroker as exc:
            raise _adapter.TopologyError(
                f"cannot read {dead_letter_queue!r}: {exc.reply_text}"
            ) from exc
        return int(declared.method.message_count)
    finally:
        _connection.close_quietly(connection)


def open_connection(url: str) -> Any:
    """A connection for the replay: a few tries, then the adapter's BrokerUnavailable."""
    params = _connection.parameters(url, {}, f"consumerdedup:replay:{os.getpid()}")
    return _connection.connect(
        params,
        backoff=Backoff(timedelta(milliseconds=200), timedelta(seconds=2)),
        give_up_after=timedelta(seconds=10),
        stopping=lambda: False,
        pause=time.sleep,
    )
