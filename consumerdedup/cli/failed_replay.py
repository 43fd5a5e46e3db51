"""``consumerdedup failed replay``: forget the FAILED records of a DLQ's dead letters, then
move the letters back to their source queue (RabbitMQ) or topic (Kafka); consumerdedup.failed's
rabbitmq and kafka modules do the work. ``--dry-run`` says what would move; without ``--yes``
the operator confirms first; a line per letter republished, then a summary: how many were
replayed (and of them, how many had no record at all), how many FAILED records were
forgotten, how many were kept with why, and how many the filters left in the DLQ.

The filters (``--consumer``, ``--reason``, ``--error-type``, ``--since``, ``--until``,
``--only-recorded``) are consumerdedup.failed.selection's, where the rule for a letter
without a record is written. Exit codes: 0 all done (nothing kept; nothing selected
counts), 3 partly done (some replayed, some kept), 1 failed (some kept, none replayed, or
a runtime error), 2 a usage error.
"""

from __future__ import annotations

import argparse
import importlib
import os
import threading
from collections.abc import Callable
from typing import Any

from ..errors import ConfigurationError
from ..failed import KAFKA_GROUP as GROUP
from ..failed.report import ReplayReport
from ..failed.selection import Selection
from ..headers import DEAD_LETTER_SUFFIX, ID_HEADER
from .common import UsageError, open_reading, printable
from .confirm import add_change_options, confirm, named
from .when import add_time_range, parse_time

EXIT_CODES = {"done": 0, "partly": 3, "failed": 1}
"""By ReplayReport.outcome: all done, partly done, nothing done (some kept)."""
PAUSE_AFTER = "CONSUMERDEDUP_REPLAY_PAUSE_AFTER"
"""A test hook: ``failed replay`` stops for good after this many confirmed copies, before
acking the last one off the DLQ (so a test can kill it at the worst moment)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    broker = parser.add_mutually_exclusive_group(required=True)
    broker.add_argument("--rabbitmq", metavar="URL", help="amqp://user:password@host:5672/%%2F")
    broker.add_argument("--kafka", metavar="BOOTSTRAP", help="host:9092[,host:9092...]")
    broker.add_argument(
        "--celery-app",
        metavar="MODULE:APP",
        help="Celery tasks (IdempotentTask): the app whose broker holds QUEUE.dlq",
    )
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
    chosen = parser.add_argument_group("which dead letters (default: all)")
    chosen.add_argument("--consumer", help="refused by this consumer")
    chosen.add_argument("--reason", metavar="TEXT", help="whose reason contains TEXT (any case)")
    chosen.add_argument(
        "--error-type", metavar="NAME", help="whose reason names this exception type (KeyError)"
    )
    add_time_range(chosen, "failed (by its FAILED record; a letter without one has no time)")
    chosen.add_argument(
        "--only-recorded",
        action="store_true",
        help="keep letters with no record at all (pruned or forgotten) instead of replaying them",
    )
    add_change_options(parser)


def run(args: argparse.Namespace) -> int:
    selection = _selection(args)  # bad input is a usage error before anything connects
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
        "selection": selection,
    }
    if args.kafka:
        return _replay_kafka(args, engine, options)
    if args.topic or args.dead_letter_topic:
        raise UsageError("--topic and --dead-letter-topic are for --kafka")
    if args.celery_app:
        return _replay_celery(args, engine, options)
    from ..failed import rabbitmq

    args.secrets.add_url(args.rabbitmq)
    dlq = args.dead_letter_queue or args.queue + DEAD_LETTER_SUFFIX
    _names("queue", dlq, args.queue, args.to)
    if not args.dry_run:
        waiting = rabbitmq.waiting(args.rabbitmq, dlq)
        if not waiting:
            print(f"no dead letters in {dlq!r}: nothing to replay")
            return 0
        up_to = waiting if args.limit is None else min(waiting, args.limit)
        chosen = " the filters take" if options["selection"].filters else ""
        confirm(
            args,
            f"replay up to {up_to} dead letter(s) of {dlq!r}{chosen}: forget their FAILED "
            "records and republish them to their source queue?",
        )
    return _summary(args, dlq, rabbitmq.replay(engine, args.rabbitmq, dlq, **options))


def _replay_celery(args: argparse.Namespace, engine: Any, options: dict[str, Any]) -> int:
    """Celery's dead letters, on the broker the app names (its URL never printed)."""
    try:
        from ..failed import celery
    except ModuleNotFoundError as missing:
        raise UsageError(
            "--celery-app needs Celery: pip install 'consumerdedup[celery]'"
        ) from missing

    dlq = args.dead_letter_queue or args.queue + DEAD_LETTER_SUFFIX
    _names("queue", dlq, args.queue, args.to)
    try:
        app = celery.load_celery_app(args.celery_app)
    except ConfigurationError as error:
        raise UsageError(str(error)) from None
    args.secrets.add_url(str(app.conf.broker_url or ""))
    if not args.dry_run:
        waiting = celery.waiting(app, dlq)
        if not waiting:
            print(f"no dead letters in {dlq!r}: nothing to replay")
            return 0
        up_to = waiting if args.limit is None else min(waiting, args.limit)
        confirm(
            args,
            f"replay up to {up_to} Celery task(s) of {dlq!r}: forget their FAILED records "
            "and send them again to their source queue?",
        )
    return _summary(args, dlq, celery.replay(engine, app, dlq, **options))


def _replay_kafka(args: argparse.Namespace, engine: Any, options: dict[str, Any]) -> int:
    if args.queue or args.dead_letter_queue:
        raise UsageError("--queue and --dead-letter-queue are for --rabbitmq")
    from ..failed import kafka

    dlq = args.dead_letter_topic or args.topic + DEAD_LETTER_SUFFIX
    _names("topic", dlq, args.topic, args.to)
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


def _names(kind: str, dlq: str, source: str | None, to: str | None) -> None:
    """The dead-letter queue or topic, the source and ``--to`` are names the broker can
    take, checked before anything connects (``--topic ..`` tried the broker first)."""
    given = (("the dead-letter " + kind, dlq), ("--" + kind, source), ("--to", to))
    for flag, name in given:
        if name is None:
            continue
        if kind == "topic":
            config: Any = importlib.import_module("consumerdedup.adapters.kafka.config")
            ok = bool(config.TOPIC_NAME.fullmatch(name))
            expected = config.TOPIC_RULE
        else:
            ok = bool(name.strip()) and "\x00" not in name and len(name.encode()) <= 255
            expected = "a RabbitMQ queue name: not empty, at most 255 bytes, no NUL"
        if not ok:
            raise UsageError(f"{flag} {name!r:.300}: expected {expected}")


def _selection(args: argparse.Namespace) -> Selection:
    try:
        return Selection(
            consumer=args.consumer,
            reason=args.reason,
            error_type=args.error_type,
            since=parse_time(args.since, "--since"),
            until=parse_time(args.until, "--until"),
            only_recorded=args.only_recorded,
        )
    except ConfigurationError as error:
        said = str(
            error
        )  # named as the command line names it: Selection.error_type is --error-type
        for name in ("consumer", "reason", "error_type", "since", "until", "only_recorded"):
            said = said.replace(f"Selection.{name}", "--" + name.replace("_", "-"))
        raise UsageError(said) from None


def _summary(args: argparse.Namespace, dlq: str, report: ReplayReport) -> int:
    verb = "would replay" if args.dry_run else "replayed"
    if args.dry_run:
        for letter in report.replayed:
            print(
                f"would replay {_letter(letter.consumer)} {_letter(letter.message_id)} -> "
                f"{_letter(args.to or letter.source)}"
            )
    for letter, why in report.kept:
        print(f"kept in {dlq}: {_letter(letter.message_id or '(no id)')}: {printable(why)}")
    if report.unrecorded:
        ids = [str(letter.message_id) for letter in report.unrecorded]
        print(
            f"{verb} {len(ids)} dead letter(s) with no record at all (pruned or forgotten: "
            f"processed as new messages; --only-recorded keeps them){named(ids)}"
        )
    forgot = "would forget" if args.dry_run else "forgot"
    line = (
        f"{verb} {len(report.replayed)} dead letter(s) from {dlq!r} "
        f"({len(report.unrecorded)} without any record); {forgot} "
        f"{report.forgotten} FAILED record(s); {len(report.kept)} kept in the DLQ"
    )
    if report.skipped:
        line += f"; {report.skipped} not selected by the filters, left there"
    print(line)
    return EXIT_CODES[report.outcome]


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
