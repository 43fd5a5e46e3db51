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
(db.cursors: the last row's id, checked when read back). For users who build their own admin page;
``consumerdedup outbox ...`` is these functions on the command line.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, Row, Table, func, select, update

from ..db import cursors
from ..errors import ConfigurationError
from ..schema import DEFAULT, ID_LENGTH, Tables, utcnow

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
    destination: str | None = None,
    key: str | None = None,
    tables: Tables = DEFAULT,
) -> Page:
    """One page of parked events (with ``abandoned``: of abandoned ones) in id order, after
    ``after`` (a cursor from an earlier page), of one ``destination`` and one ``key`` if
    given; no total count. ConfigurationError on a bad limit or cursor."""
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_LIMIT:
        raise ConfigurationError(f"limit must be an int in 1..{MAX_LIMIT}, got {limit!r}")
    ob = tables.outbox
    state = ob.c.abandoned_at.is_not(None) if abandoned else _parked(ob)
    query = _select(ob).where(ob.c.published_at.is_(None), state)
    if destination is not None:
        query = query.where(ob.c.destination == destination)
    if key is not None:
        query = query.where(ob.c.key == key)
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


def backlog(engine: Engine, *, tables: Tables = DEFAULT) -> list[dict[str, Any]]:
    """Per destination, what waits to go out: unpublished (parked included), parked, and
    the oldest unpublished event's time; abandoned and published rows are not counted."""
    ob = tables.outbox
    waiting = ob.c.published_at.is_(None) & ob.c.abandoned_at.is_(None)
    query = (
        select(
            ob.c.destination,
            func.count(),
            func.count(ob.c.parked_at),
            func.min(ob.c.created_at),
        )
        .where(waiting)
        .group_by(ob.c.destination)
        .order_by(func.count().desc(), ob.c.destination)
    )
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    return [
        {"destination": d, "unpublished": int(n), "parked": int(p), "oldest": _utc(at)}
        for d, n, p, at in rows
    ]


def behind(
    engine: Engine, event: OutboxEvent, *, limit: int = 20, tables: Tables = DEFAULT
) -> tuple[int, list[OutboxEvent]]:
    """What a parked keyed event holds back (its key's head-of-line block): how many
    unpublished events of the same destination and key come after it, and the first
    ``limit`` of them in id order. An event without a key holds nothing back."""
    if event.key is None:
        return 0, []
    ob = tables.outbox
    where = (
        ob.c.destination == event.destination,
        ob.c.key == event.key,
        ob.c.id > event.id,
        ob.c.published_at.is_(None),
        ob.c.abandoned_at.is_(None),
    )
    with engine.connect() as conn:
        total = conn.execute(select(func.count()).select_from(ob).where(*where)).scalar_one()
        rows = conn.execute(_select(ob).where(*where).order_by(ob.c.id).limit(limit)).all()
    return int(total), [_event(row) for row in rows]


def encode(row_id: int) -> str:
    return cursors.encode(_CURSOR_TAG, row_id)


def decode(cursor: str) -> int:
    """The row id a cursor stands for; InvalidCursor (a ConfigurationError) if it is not
    one of ours."""
    (row_id,) = cursors.decode(cursor, _CURSOR_TAG, (int,), longest=ID_LENGTH)
    return int(row_id)


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
                found = list(conn.execute(select(ob.c.event_id).where(*where)).scalars())
            elif conn.dialect.update_returning:
                statement = update(ob).where(*where).values(**values).returning(ob.c.event_id)
                found = list(conn.execute(statement).scalars())
            else:  # MySQL, MariaDB: no UPDATE ... RETURNING; the rows locked, then changed
                locked = select(ob.c.event_id).where(*where).with_for_update()
                found = list(conn.execute(locked).scalars())
                if found:
                    conn.execute(update(ob).where(ob.c.event_id.in_(found)).values(**values))
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
