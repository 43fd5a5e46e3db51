"""``consumerdedup failed replay``: forget the FAILED records of a DLQ's dead letters, then
move the letters back to their source queue (RabbitMQ) or topic (Kafka); consumerdedup.failed's
rabbitmq and kafka modules do the work. ``--dry-run`` says what would move; without ``--yes``
the operator confirms first; a line per letter republished, then how many.
"""

from __future__ import annotations

import argparse
import os
import threading
from collections.abc import Callable
from typing import Any

from ..failed import KAFKA_GROUP as GROUP
from ..headers import DEAD_LETTER_SUFFIX, ID_HEADER
from .common import UsageError, open_reading, printable
from .confirm import add_change_options, confirm

PAUSE_AFTER = "CONSUMERDEDUP_REPLAY_PAUSE_AFTER"
"""A test hook: ``failed replay`` stops for good after this many confirmed copies, before
acking the last one off the DLQ (so a test can kill it at the worst moment)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    broker = parser.add_mutually_exclusive_group(required=True)
    broker.add_argument("--rabbitmq", metavar="URL", help="amqp://user:password@host:5672/%%2F")
    broker.add_argument("--kafka", metavar="BOOTSTRAP", help="host:9092[,host:9092...]")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--queue", help=f"RabbitMQ: the source queue (DLQ QUEUE{DEAD_LETTER_SUFFIX})"
    )
    where.add_argument("--dead-letter-queue", metavar="DLQ", help="RabbitMQ: the DLQ")
    where.add_argument("--topic", help=f"Kafka: the source topic (DLQ TOPIC{DEAD_LETTER_SUFFIX})")
    where.add_argument("--dead-letter-topic", metavar="DLQ", help="Kafka: the DLQ topic")
    parser.add_argument(
        "--to", metavar="NAME", help="republish to this queue or topic, not each letter's source"
    )
    parser.add_argument(
        "--id-header", default=ID_HEADER, help="header read for the id (default %(default)s)"
    )
    parser.add_argument("--limit", type=int, help="replay this many dead letters at most")
    parser.add_argument(
        "--group", default=GROUP, help="Kafka: the group whose DLQ offsets are committed"
    )
    parser.add_argument(
        "--from-offset", type=int, help="Kafka: start here, not at the group's committed offset"
    )
    parser.add_argument(
        "--idempotent-producer", action="store_true", help="Kafka: for brokers that grant it"
    )
    add_change_options(parser)


def run(args: argparse.Namespace) -> int:
    _, engine, tables = open_reading(args, lambda t: t.processed_events)
    if args.limit is not None and args.limit < 1:
        raise UsageError("--limit must be positive")
    options: dict[str, Any] = {
        "tables": tables,
        "limit": args.limit,
        "to": args.to,
        "id_header": args.id_header,
        "dry_run": args.dry_run,
        "on_confirmed": _printer(),
    }
    if args.kafka:
        return _replay_kafka(args, engine, options)
    if args.topic or args.dead_letter_topic:
        raise UsageError("--topic and --dead-letter-topic are for --kafka")
    from ..failed import rabbitmq

    args.secrets.add_url(args.rabbitmq)
    dlq = args.dead_letter_queue or args.queue + DEAD_LETTER_SUFFIX
    if not args.dry_run:
        waiting = rabbitmq.waiting(args.rabbitmq, dlq)
        if not waiting:
            print(f"no dead letters in {dlq!r}: nothing to replay")
            return 0
        up_to = waiting if args.limit is None else min(waiting, args.limit)
        confirm(
            args,
            f"replay {up_to} dead letter(s) of {dlq!r}: forget their FAILED records "
            "and republish them to their source queue?",
        )
    return _summary(args, dlq, rabbitmq.replay(engine, args.rabbitmq, dlq, **options))


def _replay_kafka(args: argparse.Namespace, engine: Any, options: dict[str, Any]) -> int:
    if args.queue or args.dead_letter_queue:
        raise UsageError("--queue and --dead-letter-queue are for --rabbitmq")
    from ..failed import kafka

    dlq = args.dead_letter_topic or args.topic + DEAD_LETTER_SUFFIX
    if not args.dry_run:
        confirm(
            args,
            f"replay the dead letters of {dlq!r} after group {args.group!r}'s offsets: forget "
            "their FAILED records and re-produce them to their source topic?",
        )
    options.update(
        group=args.group,
        from_offset=args.from_offset,
        idempotent_producer=args.idempotent_producer,
    )
    return _summary(args, dlq, kafka.replay(engine, args.kafka, dlq, **options))


def _summary(args: argparse.Namespace, dlq: str, report: Any) -> int:
    verb = "would replay" if args.dry_run else "replayed"
    if args.dry_run:
        for letter in report.replayed:
            print(
                f"would replay {_letter(letter.consumer)} {_letter(letter.message_id)} -> "
                f"{_letter(args.to or letter.source)}"
            )
    for letter, why in report.kept:
        print(f"kept in {dlq}: {_letter(letter.message_id or '(no id)')}: {printable(why)}")
    forgot = "would forget" if args.dry_run else "forgot"
    print(
        f"{verb} {len(report.replayed)} dead letter(s) from {dlq!r}; {forgot} "
        f"{report.forgotten} FAILED record(s); {len(report.kept)} kept in the DLQ"
    )
    return 1 if report.kept else 0


def _printer() -> Callable[[Any], None]:
    pause_after = int(os.environ.get(PAUSE_AFTER, "0") or 0)
    count = 0

    def confirmed(letter: Any) -> None:
        nonlocal count
        count += 1
        said = " ".join(_letter(v) for v in (letter.consumer, letter.message_id))
        print(f"replayed {said} -> {_letter(letter.source)}", flush=True)
        if count == pause_after:
            print("paused (test hook)", flush=True)
            threading.Event().wait()

    return confirmed


def _letter(value: Any) -> str:
    return printable(str(value))
