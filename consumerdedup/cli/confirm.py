"""A change made by the ``failed`` and ``outbox`` commands: its ``--dry-run`` and ``--yes``
options, the confirmation asked unless ``--yes``, and the ids named in its "did N" lines.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .common import CommandError, printable

SHOWN = 20  # ids named in a change's summary line


def add_change_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true", help="say what would be done, do nothing")
    parser.add_argument("--yes", action="store_true", help="do not ask for confirmation")


def confirm(args: argparse.Namespace, question: str) -> None:
    """Return if ``--yes`` or the operator answers y; else a CommandError, nothing changed."""
    if args.yes:
        return
    sys.stdout.write(f"{question} [y/N] ")
    sys.stdout.flush()
    answer = sys.stdin.readline().strip().lower()
    if answer not in ("y", "yes"):
        raise CommandError("not confirmed: nothing changed (--yes skips the question)")


def named(ids: Sequence[str]) -> str:
    """``": a, b, c"`` (the first SHOWN ids, then how many more), or "" for none."""
    if not ids:
        return ""
    more = f" and {len(ids) - SHOWN} more" if len(ids) > SHOWN else ""
    return ": " + ", ".join(printable(i) for i in ids[:SHOWN]) + more


def print_left_alone(ids: Sequence[str], done: Sequence[str], why: str) -> None:
    """A line naming the ``ids`` not in ``done`` (``why``: what they are), if any."""
    missing = [i for i in ids if i not in set(done)]
    if missing:
        print(f"{len(missing)} id(s) {why}, left alone{named(missing)}")
