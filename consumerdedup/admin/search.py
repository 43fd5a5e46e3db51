"""The Failures search: the fields of the form (or the query string) and the records'
Filters they make; times in UTC unless they name their offset."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from ..errors import ConfigurationError
from ..failed.records import Filters

FILTERS = ("consumer", "message_id", "reason", "since", "until")


def parse_time(value: str | None, name: str) -> datetime | None:
    """A time from the search form (``2026-12-05T03:00``, as a datetime-local input sends
    it): UTC unless it names its offset."""
    if not value:
        return None
    try:
        when = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ConfigurationError(
            f"{name} {value[:40]!r}: expected a time like 2026-12-05T03:00 (UTC)"
        ) from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def search_of(source: Any) -> dict[str, str]:
    """The search fields given (query string or form), empty ones left out."""
    return {name: str(source.get(name)).strip() for name in FILTERS if source.get(name)}


def filters_of(search: dict[str, str]) -> Filters:
    return Filters(
        consumer=search.get("consumer"),
        message_id=search.get("message_id"),
        reason=search.get("reason"),
        since=parse_time(search.get("since"), "since"),
        until=parse_time(search.get("until"), "until"),
    )
