"""The HTTP idempotency keys as an operator sees them: pages by route and condition, one
key's stored response, and purging a key that is expired or stuck (an in-flight claim
whose lease ran out: its worker died and no retry came).

Pages follow the table's primary key (scope, key) with an opaque cursor, so a page costs
the same however deep. A scope is ``METHOD /route`` and, when the middleware has a
principal, `` @`` and a digest of it (never the principal itself). Purge names the
condition in its DELETE: a live record, or a claim whose lease still holds, is never
deleted (a request with that key would run its endpoint again, or twice at once).
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, Row, and_, delete, or_, select, tuple_

from ..db import cursors
from ..errors import ConfigurationError
from ..schema import DEFAULT, ID_LENGTH, Tables
from ..telemetry.readings import KEY_CONDITIONS, key_conditions

DEFAULT_LIMIT = 50
MAX_LIMIT = 1000
_CURSOR_TAG = "keys"
_COLUMNS = ("scope", "key", "state", "status", "created_at", "expires_at", "locked_until")


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """One idempotency key's record; ``headers`` and ``body`` only from ``show_key``."""

    scope: str
    key: str
    state: str
    status: int | None
    created_at: datetime
    expires_at: datetime | None
    locked_until: datetime | None
    condition: str
    headers: Any = None
    body: bytes | None = None

    def as_dict(self, *, body: bool = False) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for name in (*_COLUMNS, "condition"):
            value = getattr(self, name)
            found[name] = value.isoformat() if isinstance(value, datetime) else value
        if self.headers is not None:
            found["headers"] = self.headers
        if body and self.body is not None:
            try:
                found["body"] = self.body.decode()
            except UnicodeDecodeError:
                found["body_base64"] = base64.b64encode(self.body).decode()
        return found


@dataclass(frozen=True, slots=True)
class KeyPage:
    records: list[KeyRecord]
    next_cursor: str | None


def list_keys(
    engine: Engine,
    *,
    condition: str | None = None,
    route: str | None = None,
    limit: int = DEFAULT_LIMIT,
    after: str | None = None,
    tables: Tables = DEFAULT,
) -> KeyPage:
    """One page of keys in (scope, key) order: of one condition (KEY_CONDITIONS), whose
    scope starts with ``route`` (``POST /payments``), after ``after``."""
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_LIMIT:
        raise ConfigurationError(f"limit must be an int in 1..{MAX_LIMIT}, got {limit!r}")
    if condition is not None and condition not in KEY_CONDITIONS:
        raise ConfigurationError(
            f"condition must be one of {', '.join(KEY_CONDITIONS)}, got {condition!r:.40}"
        )
    ik, now = tables.idempotency_keys, datetime.now(UTC)
    query = select(*(ik.c[name] for name in _COLUMNS))
    if condition is not None:
        query = query.where(key_conditions(ik, now)[condition])
    if route:
        query = query.where(ik.c.scope.startswith(route, autoescape=True))
    if after is not None:
        scope, key = cursors.decode(after, _CURSOR_TAG, (str, str), longest=ID_LENGTH)
        query = query.where(tuple_(ik.c.scope, ik.c.key) > tuple_(str(scope), str(key)))
    query = query.order_by(ik.c.scope, ik.c.key).limit(limit + 1)
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    found = [_record(row, now) for row in rows[:limit]]
    more = len(rows) > limit
    last = found[-1] if found else None
    cursor = cursors.encode(_CURSOR_TAG, last.scope, last.key) if more and last else None
    return KeyPage(found, cursor)


def show_key(engine: Engine, scope: str, key: str, *, tables: Tables = DEFAULT) -> KeyRecord | None:
    """The record of ``key`` in ``scope``, with its stored headers and body; None if none."""
    ik = tables.idempotency_keys
    query = select(*(ik.c[name] for name in _COLUMNS), ik.c.headers, ik.c.body).where(
        ik.c.scope == scope, ik.c.key == key
    )
    with engine.connect() as conn:
        row = conn.execute(query).first()
    return _record(row, datetime.now(UTC)) if row is not None else None


def purge(
    engine: Engine,
    keys: Iterable[tuple[str, str]],
    *,
    dry_run: bool = False,
    tables: Tables = DEFAULT,
) -> list[tuple[str, str]]:
    """Delete the records of ``keys`` (scope, key) that are expired or abandoned now; the
    keys deleted (with ``dry_run``: that would be), in the order given. A live record or
    a claim whose lease holds is left alone, checked in the DELETE itself."""
    wanted = list(dict.fromkeys(keys))
    ik = tables.idempotency_keys
    done: set[tuple[str, str]] = set()
    with engine.begin() as conn:
        for start in range(0, len(wanted), 200):
            chunk = wanted[start : start + 200]
            conditions = key_conditions(ik, datetime.now(UTC))
            where = and_(
                or_(*(and_(ik.c.scope == s, ik.c.key == k) for s, k in chunk)),
                or_(conditions["expired"], conditions["abandoned"]),
            )
            if dry_run:
                found = conn.execute(select(ik.c.scope, ik.c.key).where(where)).all()
            else:
                found = conn.execute(delete(ik).where(where).returning(ik.c.scope, ik.c.key)).all()
            done.update((str(s), str(k)) for s, k in found)
    return [key for key in wanted if key in done]


def _utc(value: datetime | None) -> datetime | None:
    return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value


def _record(row: Row[Any] | Any, now: datetime) -> KeyRecord:
    found = dict(row._mapping)
    for name in ("created_at", "expires_at", "locked_until"):
        found[name] = _utc(found[name])
    return KeyRecord(**found, condition=_condition(found, now))


def _condition(found: dict[str, Any], now: datetime) -> str:
    """key_conditions, read on one row (the SQL NULL rules kept: no expiry is not live)."""
    if found["state"] == "in_flight":
        lease = found["locked_until"]
        return "abandoned" if lease is not None and lease <= now else "in_flight"
    expires = found["expires_at"]
    if expires is None:
        return "kept"
    return "live" if expires > now else "expired"
