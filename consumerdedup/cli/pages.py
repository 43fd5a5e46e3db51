"""Lists in pages for the ``failed`` and ``outbox`` commands: the ``--limit``/``--after``/
``--json`` options, a page printed as a table (or as JSON) with its next-cursor line, and
every page walked for a change that names no ids.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

from .common import printable

CLIP = 60  # characters of a reason shown in a table's last column


class Page(Protocol):
    """What a page of records or events has: the cursor of the next page, None on the last."""

    @property
    def next_cursor(self) -> str | None: ...


P = TypeVar("P", bound=Page)


def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def add_page_options(
    parser: argparse.ArgumentParser, *, what: str, default: int, most: int
) -> None:
    """``--limit`` (``what`` per page, 1..``most``), ``--after CURSOR`` and ``--json``."""
    parser.add_argument(
        "--limit",
        type=int,
        default=default,
        help=f"{what} per page, 1..{most} (default %(default)s)",
    )
    parser.add_argument("--after", metavar="CURSOR", help="the page after this cursor")
    add_json(parser)


def print_page(
    args: argparse.Namespace,
    key: str,
    found: Sequence[Any],
    next_cursor: str | None,
    *,
    none: str,
    rows: Callable[[], list[tuple[str, ...]]],
) -> int:
    """The page as JSON (``{key: [...], "next_cursor": ...}``) with ``--json``; else the
    table ``rows()`` makes and the next page's option, or the ``none`` line. Exit 0."""
    if args.json:
        items = [item.as_dict() for item in found]
        print(json.dumps({key: items, "next_cursor": next_cursor}, indent=2))
        return 0
    if not found:
        print(none + (" after this cursor" if args.after else ""))
        return 0
    print_table(rows())
    print(f"next page: --after {next_cursor}" if next_cursor else "(last page)")
    return 0


def print_table(rows: Sequence[tuple[str, ...]]) -> None:
    """Rows (the first the heading) in columns; the last column unpadded."""
    last = len(rows[0]) - 1
    widths = [max(len(row[i]) for row in rows) for i in range(last)]
    for row in rows:
        print(
            "  ".join(cell.ljust(w) for cell, w in zip(row[:last], widths, strict=True)), row[last]
        )


def clip(text: str) -> str:
    """A reason for a table cell: printable, on one line, at most CLIP characters."""
    shown = printable(" ".join(text.split()))
    return shown if len(shown) <= CLIP else shown[: CLIP - 1] + "…"


def every_page(fetch: Callable[[str | None], P]) -> Iterator[P]:
    """Each page ``fetch(after)`` returns, from the first (after None) to the last."""
    cursor = None
    while True:
        page = fetch(cursor)
        yield page
        if page.next_cursor is None:
            return
        cursor = page.next_cursor
