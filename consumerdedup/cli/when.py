"""``--since`` / ``--until`` of the ``failed`` commands: an ISO 8601 time (UTC if it has
no offset) or a duration ago (``36h``, ``7d``)."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime

from .. import durations
from ..errors import ConfigurationError
from .common import UsageError

HELP = "ISO 8601 time (UTC if no offset) or a duration ago (36h, 7d)"


def add_time_range(parser: argparse.ArgumentParser | argparse._ArgumentGroup, what: str) -> None:
    """``--since TIME`` (inclusive) and ``--until TIME`` (exclusive) of ``what``."""
    parser.add_argument("--since", metavar="TIME", help=f"{what} at or after: {HELP}")
    parser.add_argument("--until", metavar="TIME", help=f"{what} before: {HELP}")


def parse_time(text: str | None, option: str) -> datetime | None:
    """``text`` given to ``option`` as an aware datetime (None if not given); UsageError."""
    if text is None:
        return None
    try:
        return datetime.now(UTC) - durations.parse(text, option)
    except ConfigurationError:
        pass
    except OverflowError:  # a duration so long ago that it is before year 1
        raise _out_of_range(text, option) from None
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(
            f"{option} {text!r}: expected an ISO 8601 time or a duration ({durations.EXAMPLES})"
        ) from None
    try:  # in UTC here: 9999-12-31T23:59-23:00 is past year 9999 there (it broke at the query)
        return value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)
    except OverflowError:
        raise _out_of_range(text, option) from None


def _out_of_range(text: str, option: str) -> UsageError:
    return UsageError(f"{option} {text!r}: out of range (a time from year 1 to 9999, in UTC)")
