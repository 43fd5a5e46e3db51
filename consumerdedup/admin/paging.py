"""Keyset pages on the admin pages (Failures, Outbox, Idempotency keys): the link to the
next page (``?after=`` its cursor) carries the page's whole query, so the next page reads
the same search from where this one ended."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode


def next_link(query: Mapping[str, Any], cursor: str | None, **more: Any) -> str | None:
    """``?query&after=cursor&more``; None on the last page (no cursor)."""
    if not cursor:
        return None
    return "?" + urlencode({**query, "after": cursor, **more})
