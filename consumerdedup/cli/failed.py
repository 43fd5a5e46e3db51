"""``consumerdedup failed list|show|forget|replay`` and ``consumerdedup forget``: the FAILED
records a bad deploy left, seen in pages, forgotten so redeliveries run again, and the
dead letters moved back to where they came from (consumerdedup.failed does the work;
``replay`` is failed_replay.py).

Every change has ``--dry-run``, asks for confirmation unless ``--yes``, and prints what it
did and how many.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigurationError
from ..failed import records
from ..failed.records import FailedRecord, Filters
from . import failed_replay
from .common import CommandError, UsageError, add_actions, open_reading, printable
from .confirm import add_change_options, confirm, named, print_left_alone
from .failed_replay import PAUSE_AFTER
from .pages import add_json, add_page_options, clip, print_page
from .when import add_time_range, parse_time

__all__ = ["FORGET", "HELP", "NAME", "PAUSE_AFTER", "add_arguments", "add_forget_ids", "run"]

NAME = "failed"
HELP = "FAILED records: list, show, forget, and replay their dead letters"
_LEFT_ALONE = "without a FAILED record (none, or completed)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_actions(
        parser,
        (
            ("list", "FAILED records in pages (--after CURSOR)", _add_list, _list),
            ("show", "one FAILED record", _add_show, _show),
            (
                "forget",
                "delete FAILED records so their redeliveries run again",
                _add_forget,
                _forget,
            ),
            (
                "replay",
                "forget, then move the dead letters back to their queue",
                failed_replay.add_arguments,
                failed_replay.run,
            ),
        ),
    )


def run(args: argparse.Namespace) -> int:  # replaced by the action's own run
    raise UsageError("failed needs an action: list, show, forget or replay")


def _filters(parser: argparse.ArgumentParser, *, consumer_required: bool = False) -> None:
    parser.add_argument("--consumer", required=consumer_required, help="of this consumer only")
    parser.add_argument("--reason", metavar="TEXT", help="whose reason contains TEXT (any case)")
    add_time_range(parser, "failed")


def _add_list(parser: argparse.ArgumentParser) -> None:
    _filters(parser)
    add_page_options(parser, what="records", default=records.DEFAULT_LIMIT, most=records.MAX_LIMIT)


def _add_show(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--consumer", required=True)
    parser.add_argument("message_id", metavar="ID")
    add_json(parser)


def _add_forget(parser: argparse.ArgumentParser) -> None:
    _filters(parser, consumer_required=True)
    parser.add_argument(
        "message_ids",
        metavar="ID",
        nargs="*",
        help="these messages (none: every FAILED record the filters match)",
    )
    add_change_options(parser)


def add_forget_ids(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--consumer", required=True)
    parser.add_argument("message_ids", metavar="ID", nargs="+")
    add_change_options(parser)


def _list(args: argparse.Namespace) -> int:
    _, engine, tables = _open(args)
    try:
        page = records.list_failed(
            engine, _read_filters(args), limit=args.limit, after=args.after, tables=tables
        )
    except ConfigurationError as error:
        raise UsageError(str(error)) from None
    return print_page(
        args,
        "records",
        page.records,
        page.next_cursor,
        none="no FAILED records",
        rows=lambda: _rows(page.records),
    )


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
        print(f"would forget {what}{named(found)}" if found else f"no {what[2:]} to forget")
        print_left_alone(ids, found, _LEFT_ALONE)
        return 0
    confirm(args, f"forget {what}, so their next deliveries are processed again?")
    done = records.forget(engine, args.consumer, found, tables=tables)
    print(f"forgot {len(done)} FAILED record(s) of {args.consumer!r}{named(done)}")
    print_left_alone(ids, done, _LEFT_ALONE)
    return 0


def _open(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    return open_reading(args, lambda tables: tables.processed_events)  # the only one read here


def _read_filters(args: argparse.Namespace) -> Filters:
    return Filters(
        consumer=args.consumer,
        reason=args.reason,
        since=parse_time(args.since, "--since"),
        until=parse_time(args.until, "--until"),
    )


def _matching(engine: Any, tables: Any, filters: Filters) -> list[str]:
    return records.matching(engine, filters, tables=tables).get(filters.consumer or "", [])


def _rows(found: Sequence[FailedRecord]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = [("CONSUMER", "MESSAGE ID", "FAILED AT", "REASON")]
    for r in found:
        rows.append(
            (
                printable(r.consumer),
                printable(r.message_id),
                r.failed_at.strftime("%Y-%m-%d %H:%M:%S"),
                clip(r.reason or ""),
            )
        )
    return rows


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
