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

from ..errors import ConfigurationError
from ..headers import CONSUMER_HEADER, ID_HEADER, REASON_HEADER, SOURCE_HEADER
from ..retry import Backoff
from ..schema import DEFAULT, Tables
from .records import forget
from .report import DeadLetter, ReplayReport

# The adapter installs as consumerdedup.adapters from adapters/ (not on mypy's path).
_adapter: Any = importlib.import_module("consumerdedup.adapters.rabbitmq")
_connection: Any = importlib.import_module("consumerdedup.adapters.rabbitmq.connection")

BATCH = 100
"""Dead letters taken per round: one DELETE forgets their records."""
_OURS = (REASON_HEADER, CONSUMER_HEADER, SOURCE_HEADER)


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
) -> ReplayReport:
    """Replay up to ``limit`` (None: all) of the dead letters now in ``dead_letter_queue``
    to their source queue (``to``: to that queue instead). With ``dry_run`` nothing is
    forgotten, published or acked: every dead letter taken is given back. ``on_confirmed``
    is called after a copy is confirmed and before its dead letter is acked."""
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ConfigurationError(f"limit must be a positive int or None, got {limit!r}")
    connection = _open(url)
    report = ReplayReport(dead_letter_queue)
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        try:
            waiting = channel.queue_declare(dead_letter_queue, passive=True).method.message_count
        except pika.exceptions.ChannelClosedByBroker as exc:
            raise _adapter.TopologyError(
                f"cannot read {dead_letter_queue!r}: {exc.reply_text}"
            ) from exc
        todo = waiting if limit is None else min(limit, waiting)
        held: list[int] = []  # tags given back at the end: kept, or all of a dry run
        while todo > 0:
            batch = _take(channel, dead_letter_queue, min(BATCH, todo), id_header)
            if not batch:
                break
            todo -= len(batch)
            # Only what can go back is forgotten: a letter kept keeps its FAILED record listed.
            verdicts = _verdicts(connection, batch, to)
            going = [t for t, why in zip(batch, verdicts, strict=True) if why is None]
            report.forgotten += _forget(engine, tables, going, dry_run)
            for (tag, letter, properties, body), why in zip(batch, verdicts, strict=True):
                if why is None and not dry_run:
                    why = _republish(channel, to or str(letter.source), properties, body)
                if why is not None:
                    report.kept.append((letter, why))
                    held.append(tag)
                    continue
                report.replayed.append(letter)
                if dry_run:
                    held.append(tag)
                    continue
                if on_confirmed is not None:
                    on_confirmed(letter)
                channel.basic_ack(tag)
        for tag in held:  # back to the DLQ, in their places
            channel.basic_nack(tag, requeue=True)
    finally:
        _connection.close_quietly(connection)
    return report


Taken = tuple[int, DeadLetter, Any, bytes]


def _take(channel: Any, queue: str, count: int, id_header: str) -> list[Taken]:
    batch: list[Taken] = []
    for _ in range(count):
        method, properties, body = channel.basic_get(queue, auto_ack=False)
        if method is None:
            break
        headers = properties.headers if isinstance(properties.headers, dict) else {}
        message_id = properties.message_id or headers.get(id_header)
        letter = DeadLetter(
            consumer=_text(headers.get(CONSUMER_HEADER)),
            message_id=_text(message_id),
            source=_text(headers.get(SOURCE_HEADER)),
            reason=_text(headers.get(REASON_HEADER)),
        )
        batch.append((method.delivery_tag, letter, properties, body))
    return batch


def _verdicts(connection: Any, batch: Sequence[Taken], to: str | None) -> list[str | None]:
    """Why each dead letter of ``batch`` cannot go back (None: it can): its headers, or a
    source queue the broker no longer has (deleted since)."""
    verdicts = [_unreplayable(letter, properties, to) for _, letter, properties, _ in batch]
    targets = [to or str(letter.source) for _, letter, _, _ in batch]
    gone = _missing_queues(
        connection, {q for q, why in zip(targets, verdicts, strict=True) if why is None}
    )
    return [
        f"no queue {q!r} to return to" if why is None and q in gone else why
        for q, why in zip(targets, verdicts, strict=True)
    ]


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


def _forget(engine: Engine, tables: Tables, batch: Sequence[Taken], dry_run: bool) -> int:
    """Forget the batch's FAILED records, per consumer, before any copy is published."""
    by_consumer: dict[str, list[str]] = {}
    for _, letter, _, _ in batch:
        if letter.consumer and letter.message_id:
            by_consumer.setdefault(letter.consumer, []).append(letter.message_id)
    return sum(
        len(forget(engine, consumer, ids, dry_run=dry_run, tables=tables))
        for consumer, ids in by_consumer.items()
    )


def _unreplayable(letter: DeadLetter, properties: Any, to: str | None) -> str | None:
    headers = properties.headers if isinstance(properties.headers, dict) else {}
    if _adapter.BODY_DROPPED_HEADER in headers:
        return "dead-lettered without its body (the broker refused the full copy)"
    if not to and not letter.source:
        return f"no {SOURCE_HEADER} header: pass --to QUEUE"
    if letter.consumer is None:
        return f"no {CONSUMER_HEADER} header: its record cannot be forgotten"
    if letter.message_id is None:
        return "no message id (message_id property or id header): its record cannot be found"
    return None


def _republish(channel: Any, queue: str, properties: Any, body: bytes) -> str | None:
    """Publish the original properties back to ``queue`` and wait for the confirm; why not,
    if the broker did not confirm it."""
    original = copy.copy(properties)
    headers = properties.headers if isinstance(properties.headers, dict) else {}
    original.headers = {k: v for k, v in headers.items() if k not in _OURS}
    try:
        channel.basic_publish("", queue, body, original, mandatory=True)
    except pika.exceptions.UnroutableError:
        return f"no queue {queue!r} to return to"
    except pika.exceptions.NackError:
        return f"the broker refused the copy to {queue!r}"
    return None


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def waiting(url: str, dead_letter_queue: str) -> int:
    """How many dead letters ``dead_letter_queue`` holds now."""
    connection = _open(url)
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


def _open(url: str) -> Any:
    """A connection for the replay: a few tries, then the adapter's BrokerUnavailable."""
    params = _connection.parameters(url, {}, f"consumerdedup:replay:{os.getpid()}")
    return _connection.connect(
        params,
        backoff=Backoff(timedelta(milliseconds=200), timedelta(seconds=2)),
        give_up_after=timedelta(seconds=10),
        stopping=lambda: False,
        pause=time.sleep,
    )
