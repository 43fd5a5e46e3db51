"""``consumerdedup outbox list|show|replay|abandon``: the outbox events relays parked after
``max_attempts`` failed publishes, seen in pages, put back for the relay, or given up on
(consumerdedup.outbox.parked does the work).

Every change has ``--dry-run``, asks for confirmation unless ``--yes``, and prints what it
did and how many.
"""

from __future__ import annotations

import argparse
import getpass
import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine, Table

from ..db import catalog
from ..errors import ConfigurationError
from ..outbox import parked
from ..outbox.parked import OutboxEvent
from .common import PROG, CommandError, UsageError, add_actions, open_reading, printable
from .confirm import add_change_options, confirm, named, print_left_alone
from .pages import add_json, add_page_options, clip, every_page, print_page

NAME = "outbox"
HELP = "parked outbox events: list, show, replay (publish again), abandon"
_LEFT_ALONE = "not parked (pending, published, abandoned or unknown)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_actions(
        parser,
        (
            ("list", "parked events in pages (--after CURSOR)", _add_list, _list),
            ("show", "one outbox event, whatever its state", _add_show, _show),
            ("replay", "un-park events: the relay publishes them again", _add_replay, _replay),
            (
                "abandon",
                "give up on parked events: never published, key released",
                _add_abandon,
                _abandon,
            ),
        ),
    )


def run(args: argparse.Namespace) -> int:  # replaced by the action's own run
    raise UsageError("outbox needs an action: list, show, replay or abandon")


def _add_list(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--abandoned", action="store_true", help="the abandoned events instead (kept as records)"
    )
    add_page_options(parser, what="events", default=parked.DEFAULT_LIMIT, most=parked.MAX_LIMIT)


def _add_show(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("event_id", metavar="EVENT_ID")
    add_json(parser)


def _add_replay(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("event_ids", metavar="EVENT_ID", nargs="*", help="these parked events")
    parser.add_argument("--all", action="store_true", help="every parked event")
    add_change_options(parser)


def _add_abandon(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("event_ids", metavar="EVENT_ID", nargs="+", help="these parked events")
    parser.add_argument("--reason", required=True, help="why (kept on the row)")
    parser.add_argument("--by", help="who (kept on the row; default: the OS user)")
    add_change_options(parser)


def _list(args: argparse.Namespace) -> int:
    engine, tables = _open(args)
    try:
        page = parked.list_parked(
            engine, abandoned=args.abandoned, limit=args.limit, after=args.after, tables=tables
        )
    except ConfigurationError as error:
        raise UsageError(str(error)) from None
    state = "abandoned" if args.abandoned else "parked"
    return print_page(
        args,
        "events",
        page.events,
        page.next_cursor,
        none=f"no {state} outbox events",
        rows=lambda: _rows(page.events, abandoned=args.abandoned),
    )


def _show(args: argparse.Namespace) -> int:
    engine, tables = _open(args)
    event = parked.show(engine, args.event_id, tables=tables)
    if event is None:
        raise CommandError(f"no outbox event {args.event_id!r} in {tables.outbox.fullname}")
    if args.json:
        print(json.dumps(event.as_dict(), indent=2))
    else:
        for key, value in event.as_dict().items():
            shown = json.dumps(value) if isinstance(value, dict) else value
            print(f"{key + ':':17} {'-' if value is None else printable(str(shown))}")
    return 0


def _replay(args: argparse.Namespace) -> int:
    engine, tables = _open(args)
    ids = list(args.event_ids)
    if args.all == bool(ids):
        raise UsageError("give EVENT_IDs or --all, not both nor neither")
    if args.all:
        ids = _every_parked(engine, tables)
    found = parked.replay(engine, ids, dry_run=True, tables=tables)
    if args.dry_run or not found:
        verb = "would replay" if args.dry_run else "replayed"
        print(f"{verb} {len(found)} parked event(s){named(found)}")
        print_left_alone(ids, found, _LEFT_ALONE)
        return 0
    confirm(args, f"replay {len(found)} parked event(s): the relay publishes them again?")
    done = parked.replay(engine, found, tables=tables)
    print(f"replayed {len(done)} parked event(s){named(done)}")
    print_left_alone(ids, done, _LEFT_ALONE)
    return 0


def _abandon(args: argparse.Namespace) -> int:
    engine, tables = _open(args)
    ids, by = list(args.event_ids), args.by or _os_user()
    if not args.reason.strip() or not by.strip():
        raise UsageError("--reason and --by must not be empty")
    found = parked.abandon(engine, ids, by=by, reason=args.reason, dry_run=True, tables=tables)
    if args.dry_run or not found:
        verb = "would abandon" if args.dry_run else "abandoned"
        print(f"{verb} {len(found)} parked event(s) as {by!r}{named(found)}")
        print_left_alone(ids, found, _LEFT_ALONE)
        return 0
    confirm(
        args,
        f"abandon {len(found)} parked event(s) for good (never published; the later events "
        "of their keys go out)?",
    )
    done = parked.abandon(engine, found, by=by, reason=args.reason, tables=tables)
    print(f"abandoned {len(done)} parked event(s) as {by!r}{named(done)}")
    print_left_alone(ids, done, _LEFT_ALONE)
    return 0


def _open(args: argparse.Namespace) -> tuple[Any, Any]:
    _, engine, tables = open_reading(args, lambda t: t.outbox)  # the only one read here
    require_columns(engine, tables.outbox)
    return engine, tables


def require_columns(engine: Engine, table: Table) -> None:
    """CommandError naming the columns an older release's table lacks (parked_at, ...)."""
    with engine.connect() as conn:
        missing = catalog.missing_columns(conn, table)
    if missing:
        names = ", ".join(column.name for column in missing)
        raise CommandError(
            f"table {table.fullname} lacks column(s) {names} (made by an older release): "
            f"run `{PROG} init-db`, which adds them"
        )


def _os_user() -> str:
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no login name, no passwd entry
        raise UsageError("cannot tell the OS user: pass --by WHO") from None


def _every_parked(engine: Any, tables: Any) -> list[str]:
    def fetch(after: str | None) -> parked.Page:
        return parked.list_parked(engine, limit=parked.MAX_LIMIT, after=after, tables=tables)

    return [event.event_id for page in every_page(fetch) for event in page.events]


def _rows(found: Sequence[OutboxEvent], *, abandoned: bool) -> list[tuple[str, ...]]:
    head = (
        "EVENT ID",
        "DESTINATION",
        "KEY",
        "ATTEMPTS",
        "ABANDONED AT" if abandoned else "PARKED AT",
    )
    rows: list[tuple[str, ...]] = [(*head, "BY: REASON" if abandoned else "REASON")]
    for e in found:
        at = e.abandoned_at if abandoned else e.parked_at
        why = f"{e.abandoned_by}: {e.abandoned_reason}" if abandoned else (e.parked_reason or "")
        rows.append(
            (
                printable(e.event_id),
                printable(e.destination),
                printable(e.key or "-"),
                str(e.attempts),
                at.strftime("%Y-%m-%d %H:%M:%S") if at else "-",
                clip(why),
            )
        )
    return rows
