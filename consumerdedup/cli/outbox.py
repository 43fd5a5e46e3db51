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
import sys
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine, Table

from ..db import catalog
from ..errors import ConfigurationError
from ..outbox import parked
from ..outbox.parked import OutboxEvent
from .common import PROG, CommandError, UsageError, missing_tables, open_database, printable

NAME = "outbox"
HELP = "parked outbox events: list, show, replay (publish again), abandon"
_SHOWN = 20  # ids named in a change's summary line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .main import add_common  # the shared options, on each action too (no cycle at import)

    actions = parser.add_subparsers(
        dest="action", metavar="ACTION", required=True, parser_class=type(parser)
    )
    for name, helptext, add, run in (
        ("list", "parked events in pages (--after CURSOR)", _add_list, _list),
        ("show", "one outbox event, whatever its state", _add_show, _show),
        ("replay", "un-park events: the relay publishes them again", _add_replay, _replay),
        (
            "abandon",
            "give up on parked events: never published, key released",
            _add_abandon,
            _abandon,
        ),
    ):
        sub = actions.add_parser(name, help=helptext, description=helptext)
        add_common(sub, nested=True)
        add(sub)
        sub.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:  # replaced by the action's own run
    raise UsageError("outbox needs an action: list, show, replay or abandon")


def _change(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true", help="say what would be done, do nothing")
    parser.add_argument("--yes", action="store_true", help="do not ask for confirmation")


def _add_list(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--abandoned", action="store_true", help="the abandoned events instead (kept as records)"
    )
    parser.add_argument(
        "--limit",
        type=int,
        default=parked.DEFAULT_LIMIT,
        help=f"events per page, 1..{parked.MAX_LIMIT} (default %(default)s)",
    )
    parser.add_argument("--after", metavar="CURSOR", help="the page after this cursor")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _add_show(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("event_id", metavar="EVENT_ID")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _add_replay(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("event_ids", metavar="EVENT_ID", nargs="*", help="these parked events")
    parser.add_argument("--all", action="store_true", help="every parked event")
    _change(parser)


def _add_abandon(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("event_ids", metavar="EVENT_ID", nargs="+", help="these parked events")
    parser.add_argument("--reason", required=True, help="why (kept on the row)")
    parser.add_argument("--by", help="who (kept on the row; default: the OS user)")
    _change(parser)


def _list(args: argparse.Namespace) -> int:
    engine, tables = _open(args)
    try:
        page = parked.list_parked(
            engine, abandoned=args.abandoned, limit=args.limit, after=args.after, tables=tables
        )
    except ConfigurationError as error:
        raise UsageError(str(error)) from None
    if args.json:
        found = [event.as_dict() for event in page.events]
        print(json.dumps({"events": found, "next_cursor": page.next_cursor}, indent=2))
        return 0
    state = "abandoned" if args.abandoned else "parked"
    if not page.events:
        print(f"no {state} outbox events" + (" after this cursor" if args.after else ""))
        return 0
    _table(page.events, abandoned=args.abandoned)
    print(f"next page: --after {page.next_cursor}" if page.next_cursor else "(last page)")
    return 0


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
        print(f"{verb} {len(found)} parked event(s){_named(found)}")
        _unmatched(ids, found)
        return 0
    _confirm(args, f"replay {len(found)} parked event(s): the relay publishes them again?")
    done = parked.replay(engine, found, tables=tables)
    print(f"replayed {len(done)} parked event(s){_named(done)}")
    _unmatched(ids, done)
    return 0


def _abandon(args: argparse.Namespace) -> int:
    engine, tables = _open(args)
    ids, by = list(args.event_ids), args.by or _os_user()
    if not args.reason.strip() or not by.strip():
        raise UsageError("--reason and --by must not be empty")
    found = parked.abandon(engine, ids, by=by, reason=args.reason, dry_run=True, tables=tables)
    if args.dry_run or not found:
        verb = "would abandon" if args.dry_run else "abandoned"
        print(f"{verb} {len(found)} parked event(s) as {by!r}{_named(found)}")
        _unmatched(ids, found)
        return 0
    _confirm(
        args,
        f"abandon {len(found)} parked event(s) for good (never published; the later events "
        "of their keys go out)?",
    )
    done = parked.abandon(engine, found, by=by, reason=args.reason, tables=tables)
    print(f"abandoned {len(done)} parked event(s) as {by!r}{_named(done)}")
    _unmatched(ids, done)
    return 0


def _open(args: argparse.Namespace) -> tuple[Any, Any]:
    _, engine, tables = open_database(args)
    if tables.outbox in missing_tables(engine, tables):  # the only one read here
        raise CommandError(f"table {tables.outbox.fullname} not found; run `{PROG} init-db` first")
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
    ids: list[str] = []
    cursor = None
    while True:
        page = parked.list_parked(engine, limit=parked.MAX_LIMIT, after=cursor, tables=tables)
        ids += [event.event_id for event in page.events]
        if page.next_cursor is None:
            return ids
        cursor = page.next_cursor


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
            f"{len(missing)} id(s) not parked (pending, published, abandoned or unknown), "
            f"left alone{_named(missing)}"
        )


def _table(found: Sequence[OutboxEvent], *, abandoned: bool) -> None:
    head = (
        "EVENT ID",
        "DESTINATION",
        "KEY",
        "ATTEMPTS",
        "ABANDONED AT" if abandoned else "PARKED AT",
    )
    rows = [(*head, "BY: REASON" if abandoned else "REASON")]
    for e in found:
        at = e.abandoned_at if abandoned else e.parked_at
        why = f"{e.abandoned_by}: {e.abandoned_reason}" if abandoned else (e.parked_reason or "")
        why = printable(" ".join(why.split()))
        rows.append(
            (
                printable(e.event_id),
                printable(e.destination),
                printable(e.key or "-"),
                str(e.attempts),
                at.strftime("%Y-%m-%d %H:%M:%S") if at else "-",
                why if len(why) <= 60 else why[:59] + "…",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:5], widths, strict=True)), row[5])
