"""Parked outbox events: pages over a keyset cursor, one event, replay, abandon.

A row is parked when a relay's publish of it failed ``max_attempts`` times: the relay
sets ``parked_at`` and ``parked_reason`` on it, and no relay tries it again, whatever its
own setting, while it keeps holding back the later events of its key. ``replay`` puts it
back (attempts, backoff and parked_at reset: the next relay round tries it first of its
key); ``abandon`` gives up on it for good: stamped with who, when and why, never
published, holding nothing back, kept as a record until the pruner's outbox cutoff.

Both change parked rows only, and check that in their UPDATE (parked, not abandoned, not
published), so of two operators acting on one event only the first changes it. Pages
are in id order (the outbox's primary key, unique and stable); the cursor is opaque
(base64url of the last row's id). For users who build their own admin page;
``consumerdedup outbox ...`` is these functions on the command line.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, Row, Table, select, update

from ..errors import ConfigurationError
from ..schema import DEFAULT, Tables, utcnow

DEFAULT_LIMIT = 20
MAX_LIMIT = 1000
PARKED, ABANDONED, PENDING, PUBLISHED = "parked", "abandoned", "pending", "published"
_CHUNK = 500  # ids per UPDATE: well under every driver's bound-parameter limit
_CURSOR_TAG = "outbox"


@dataclass(frozen=True, slots=True)
class OutboxEvent:
    """One outbox row as an operator sees it; ``body`` and ``headers`` only from ``show``."""

    id: int
    event_id: str
    destination: str
    key: str | None
    attempts: int
    created_at: datetime
    last_error: str | None
    parked_at: datetime | None
    parked_reason: str | None
    abandoned_at: datetime | None
    abandoned_by: str | None
    abandoned_reason: str | None
    published_at: datetime | None
    body: bytes | None = None
    headers: dict[str, Any] | None = None

    @property
    def state(self) -> str:
        """published, abandoned, parked or pending (waiting for, or backing off to, a relay)."""
        if self.published_at is not None:
            return PUBLISHED
        if self.abandoned_at is not None:
            return ABANDONED
        return PARKED if self.parked_at is not None else PENDING

    def as_dict(self) -> dict[str, Any]:
        found: dict[str, Any] = {"state": self.state}
        for name in _COLUMNS:
            value = getattr(self, name)
            found[name] = value.isoformat() if isinstance(value, datetime) else value
        if self.headers is not None:
            found["headers"] = self.headers
        if self.body is not None:
            try:
                found["body"] = self.body.decode()
            except UnicodeDecodeError:
                found["body_base64"] = base64.b64encode(self.body).decode()
        return found


_COLUMNS = (
    "id",
    "event_id",
    "destination",
    "key",
    "attempts",
    "created_at",
    "last_error",
    "parked_at",
    "parked_reason",
    "abandoned_at",
    "abandoned_by",
    "abandoned_reason",
    "published_at",
)


@dataclass(frozen=True, slots=True)
class Page:
    """Up to ``limit`` events, and the cursor of the next page (None: this was the last)."""

    events: list[OutboxEvent]
    next_cursor: str | None


def list_parked(
    engine: Engine,
    *,
    abandoned: bool = False,
    limit: int = DEFAULT_LIMIT,
    after: str | None = None,
    tables: Tables = DEFAULT,
) -> Page:
    """One page of parked events (with ``abandoned``: of abandoned ones) in id order, after
    ``after`` (a cursor from an earlier page); no total count. ConfigurationError on a bad
    limit or cursor."""
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_LIMIT:
        raise ConfigurationError(f"limit must be an int in 1..{MAX_LIMIT}, got {limit!r}")
    ob = tables.outbox
    state = ob.c.abandoned_at.is_not(None) if abandoned else _parked(ob)
    query = _select(ob).where(ob.c.published_at.is_(None), state)
    if after is not None:
        query = query.where(ob.c.id > decode(after))
    query = query.order_by(ob.c.id).limit(limit + 1)
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    events = [_event(row) for row in rows[:limit]]
    return Page(events, encode(events[-1].id) if len(rows) > limit else None)


def show(engine: Engine, event_id: str, *, tables: Tables = DEFAULT) -> OutboxEvent | None:
    """The outbox event ``event_id`` in whatever state, with its body and headers; None if
    the outbox has no such row (never added, or pruned)."""
    ob = tables.outbox
    query = _select(ob).add_columns(ob.c.body, ob.c.headers).where(ob.c.event_id == event_id)
    with engine.connect() as conn:
        row = conn.execute(query).first()
    return _event(row) if row is not None else None


def replay(
    engine: Engine,
    event_ids: Iterable[str],
    *,
    dry_run: bool = False,
    tables: Tables = DEFAULT,
) -> list[str]:
    """Un-park ``event_ids``: attempts to 0, backoff and parked_at cleared, so the next
    relay round publishes them (each before the later events of its key). Returns the ids
    replayed (with ``dry_run``: that would be), in the order given; an id that is not
    parked (pending, published, abandoned, unknown) is left alone."""
    now = utcnow()
    values = {"attempts": 0, "available_at": now, "parked_at": None, "parked_reason": None}
    return _change(engine, tables, event_ids, values, dry_run)


def abandon(
    engine: Engine,
    event_ids: Iterable[str],
    *,
    by: str,
    reason: str,
    dry_run: bool = False,
    tables: Tables = DEFAULT,
) -> list[str]:
    """Give up on parked ``event_ids``: stamped abandoned (now, ``by``, ``reason``), never
    published, and no longer holding back the later events of their keys. Returns the ids
    abandoned (with ``dry_run``: that would be), in the order given; an id that is not
    parked is left alone. The row stays as a record until the pruner's outbox cutoff."""
    for name, value in (("by", by), ("reason", reason)):
        if not isinstance(value, str) or not value.strip():
            raise ConfigurationError(f"abandon needs a non-empty {name}")
    values = {"abandoned_at": utcnow(), "abandoned_by": by, "abandoned_reason": reason}
    return _change(engine, tables, event_ids, values, dry_run)


def encode(row_id: int) -> str:
    raw = json.dumps([_CURSOR_TAG, row_id], separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode(cursor: str) -> int:
    """The row id a cursor stands for; ConfigurationError if it is not one of ours."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        tag, row_id = json.loads(raw)
        if tag == _CURSOR_TAG and isinstance(row_id, int) and not isinstance(row_id, bool):
            return row_id
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError):
        pass
    raise ConfigurationError("not a cursor from an earlier page of outbox events (--after)")


def _change(
    engine: Engine,
    tables: Tables,
    event_ids: Iterable[str],
    values: dict[str, Any],
    dry_run: bool,
) -> list[str]:
    wanted = list(dict.fromkeys(event_ids))
    ob = tables.outbox
    done: set[str] = set()
    with engine.begin() as conn:
        for start in range(0, len(wanted), _CHUNK):
            where = (ob.c.event_id.in_(wanted[start : start + _CHUNK]), _parked(ob))
            if dry_run:
                found = conn.execute(select(ob.c.event_id).where(*where)).scalars()
            else:
                statement = update(ob).where(*where).values(**values).returning(ob.c.event_id)
                found = conn.execute(statement).scalars()
            done.update(found)
    return [event_id for event_id in wanted if event_id in done]


def _parked(ob: Table) -> Any:
    """Parked now: what the relay skips, and what replay and abandon may change."""
    return ob.c.parked_at.is_not(None) & ob.c.abandoned_at.is_(None) & ob.c.published_at.is_(None)


def _select(ob: Table) -> Any:
    return select(*(ob.c[name] for name in _COLUMNS))


def _utc(value: datetime | None) -> datetime | None:
    """SQLite gives back naive datetimes; the library always writes UTC."""
    return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value


def _event(row: Row[Any]) -> OutboxEvent:
    found = dict(row._mapping)
    for name in ("created_at", "parked_at", "abandoned_at", "published_at"):
        found[name] = _utc(found[name])
    return OutboxEvent(**found)
