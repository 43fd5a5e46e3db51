"""``consumerdedup failed list|show|forget|replay`` and ``consumerdedup forget``: the FAILED
records a bad deploy left, seen in pages, forgotten so redeliveries run again, and the
dead letters moved back to where they came from (consumerdedup.failed does the work).

Every change has ``--dry-run``, asks for confirmation unless ``--yes``, and prints what it
did and how many.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from .. import durations
from ..errors import ConfigurationError
from ..failed import KAFKA_GROUP as GROUP
from ..failed import records
from ..failed.records import FailedRecord, Filters
from ..headers import DEAD_LETTER_SUFFIX, ID_HEADER
from .common import PROG, CommandError, UsageError, missing_tables, open_database, printable

NAME = "failed"
HELP = "FAILED records: list, show, forget, and replay their dead letters"
PAUSE_AFTER = "CONSUMERDEDUP_REPLAY_PAUSE_AFTER"
"""A test hook: ``failed replay`` stops for good after this many confirmed copies, before
acking the last one off the DLQ (so a test can kill it at the worst moment)."""
_SHOWN = 20  # ids named in a change's summary line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .main import add_common  # the shared options, on each action too (no cycle at import)

    actions = parser.add_subparsers(
        dest="action", metavar="ACTION", required=True, parser_class=type(parser)
    )
    for name, helptext, add, run in (
        ("list", "FAILED records in pages (--after CURSOR)", _add_list, _list),
        ("show", "one FAILED record", _add_show, _show),
        ("forget", "delete FAILED records so their redeliveries run again", _add_forget, _forget),
        ("replay", "forget, then move the dead letters back to their queue", _add_replay, _replay),
    ):
        sub = actions.add_parser(name, help=helptext, description=helptext)
        add_common(sub, nested=True)
        add(sub)
        sub.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:  # replaced by the action's own run
    raise UsageError("failed needs an action: list, show, forget or replay")


def _filters(parser: argparse.ArgumentParser, *, consumer_required: bool = False) -> None:
    parser.add_argument("--consumer", required=consumer_required, help="of this consumer only")
    parser.add_argument("--reason", metavar="TEXT", help="whose reason contains TEXT (any case)")
    when = "ISO 8601 time (UTC if no offset) or a duration ago (36h, 7d)"
    parser.add_argument("--since", metavar="TIME", help=f"failed at or after: {when}")
    parser.add_argument("--until", metavar="TIME", help=f"failed before: {when}")


def _change(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true", help="say what would be done, do nothing")
    parser.add_argument("--yes", action="store_true", help="do not ask for confirmation")


def _add_list(parser: argparse.ArgumentParser) -> None:
    _filters(parser)
    parser.add_argument(
        "--limit",
        type=int,
        default=records.DEFAULT_LIMIT,
        help=f"records per page, 1..{records.MAX_LIMIT} (default %(default)s)",
    )
    parser.add_argument("--after", metavar="CURSOR", help="the page after this cursor")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _add_show(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--consumer", required=True)
    parser.add_argument("message_id", metavar="ID")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _add_forget(parser: argparse.ArgumentParser) -> None:
    _filters(parser, consumer_required=True)
    parser.add_argument(
        "message_ids",
        metavar="ID",
        nargs="*",
        help="these messages (none: every FAILED record the filters match)",
    )
    _change(parser)


def add_forget_ids(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--consumer", required=True)
    parser.add_argument("message_ids", metavar="ID", nargs="+")
    _change(parser)


def _add_replay(parser: argparse.ArgumentParser) -> None:
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
    _change(parser)


def _list(args: argparse.Namespace) -> int:
    _, engine, tables = _open(args)
    try:
        page = records.list_failed(
            engine, _read_filters(args), limit=args.limit, after=args.after, tables=tables
        )
    except ConfigurationError as error:
        raise UsageError(str(error)) from None
    if args.json:
        found = [record.as_dict() for record in page.records]
        print(json.dumps({"records": found, "next_cursor": page.next_cursor}, indent=2))
        return 0
    if not page.records:
        print("no FAILED records" + (" after this cursor" if args.after else ""))
        return 0
    _table(page.records)
    print(f"next page: --after {page.next_cursor}" if page.next_cursor else "(last page)")
    return 0


def _show(args: argparse.Namespace) -> int:
    _, engine, tables = _open(args)
    record = records.show(engine, args.consumer, args.message_id, tables=tables)
    if record is None:
        raise CommandError(f"no FAILED record of {args.message_id!r} for {args.consumer!r}")
    if args.json:
        print(json.dumps(record.as_dict(), indent=2))
    else:
        for key, value in record.as_dict().items():
            print(f"{key + ':':12} {printable(str(value))}")
    return 0


def _forget(args: argparse.Namespace) -> int:
    _, engine, tables = _open(args)
    ids = list(args.message_ids)
    filtered = any(getattr(args, name, None) for name in ("reason", "since", "until"))
    if not ids:  # every FAILED record of the consumer that the filters match
        ids = _matching(engine, tables, _read_filters(args))
    elif filtered:
        raise UsageError("give IDs or filters (--reason, --since, --until), not both")
    found = records.forget(engine, args.consumer, ids, dry_run=True, tables=tables)
    what = f"{len(found)} FAILED record(s) of {args.consumer!r}"
    if args.dry_run or not found:
        print(f"would forget {what}{_named(found)}" if found else f"no {what[2:]} to forget")
        _unmatched(ids, found)
        return 0
    _confirm(args, f"forget {what}, so their next deliveries are processed again?")
    done = records.forget(engine, args.consumer, found, tables=tables)
    print(f"forgot {len(done)} FAILED record(s) of {args.consumer!r}{_named(done)}")
    _unmatched(ids, done)
    return 0


def _replay(args: argparse.Namespace) -> int:
    _, engine, tables = _open(args)
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
        _confirm(
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
        _confirm(
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


def _open(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    url, engine, tables = open_database(args)
    if tables.processed_events in missing_tables(engine, tables):  # the only one read here
        raise CommandError(
            f"table {tables.processed_events.fullname} not found; run `{PROG} init-db` first"
        )
    return url, engine, tables


def _read_filters(args: argparse.Namespace) -> Filters:
    return Filters(
        consumer=args.consumer,
        reason=args.reason,
        since=_time(args.since, "--since"),
        until=_time(args.until, "--until"),
    )


def _time(text: str | None, option: str) -> datetime | None:
    if text is None:
        return None
    try:
        return datetime.now(UTC) - durations.parse(text, option)
    except ConfigurationError:
        pass
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(
            f"{option} {text!r}: expected an ISO 8601 time or a duration ({durations.EXAMPLES})"
        ) from None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _matching(engine: Any, tables: Any, filters: Filters) -> list[str]:
    ids: list[str] = []
    cursor = None
    while True:
        page = records.list_failed(
            engine, filters, limit=records.MAX_LIMIT, after=cursor, tables=tables
        )
        ids += [record.message_id for record in page.records]
        if page.next_cursor is None:
            return ids
        cursor = page.next_cursor


def _letter(value: Any) -> str:
    return printable(str(value))


def _confirm(args: argparse.Namespace, question: str) -> None:
    if args.yes:
        return
    sys.stdout.write(f"{question} [y/N] ")
    sys.stdout.flush()
    answer = sys.stdin.readline().strip().lower()
    if answer not in ("y", "yes"):
        raise CommandError("not confirmed: nothing changed (--yes skips the question)")


def _named(ids: Sequence[str]) -> str:
    if not ids:
        return ""
    more = f" and {len(ids) - _SHOWN} more" if len(ids) > _SHOWN else ""
    return ": " + ", ".join(printable(i) for i in ids[:_SHOWN]) + more


def _unmatched(ids: Sequence[str], found: Sequence[str]) -> None:
    missing = [i for i in ids if i not in set(found)]
    if missing:
        print(
            f"{len(missing)} id(s) without a FAILED record (none, or completed), left alone"
            f"{_named(missing)}"
        )


def _table(found: Sequence[FailedRecord]) -> None:
    rows = [("CONSUMER", "MESSAGE ID", "FAILED AT", "REASON")]
    for r in found:
        reason = printable(" ".join((r.reason or "").split()))
        rows.append(
            (
                printable(r.consumer),
                printable(r.message_id),
                r.failed_at.strftime("%Y-%m-%d %H:%M:%S"),
                reason if len(reason) <= 60 else reason[:59] + "…",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths, strict=True)), row[3])


class _Forget:
    """``consumerdedup forget --consumer C ID...``: chosen messages processed again."""

    NAME = "forget"
    HELP = "forget the FAILED records of these messages, so their redeliveries run again"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_forget_ids(parser)

    def run(self, args: argparse.Namespace) -> int:
        args.reason = args.since = args.until = None
        return _forget(args)


FORGET = _Forget()
