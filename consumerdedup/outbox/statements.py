"""The relay's SQL: which outbox rows may go now, and what became of them.

Just past 250 lines: the claim's statements are built once, together, because each
re-asks the same conditions (``may_go``); apart they would drift.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Connection,
    Dialect,
    Text,
    all_,
    and_,
    any_,
    bindparam,
    case,
    cast,
    delete,
    exists,
    func,
    or_,
    select,
    update,
)

from ..db import direct, locks
from ..schema import Tables
from .mysql import is_mysql

WINDOW = 4
"""Rows the second pass of a PostgreSQL claim scans, as a multiple of the batch size."""
LOCK_TRIES = 3
"""Statements a round may spend taking key locks before it settles for what it has."""


class Claimed(NamedTuple):
    """A row the first pass claimed, as the direct path makes it (a Row elsewhere: the
    same names)."""

    id: int
    event_id: str
    destination: str
    key: str | None
    body: bytes
    headers: Any
    attempts: int
    scanned: int
    first: int
    """The scan's oldest id: a row of the scan that did not come back is not older."""


class Fetched(NamedTuple):
    """A row the second pass claimed, as the direct path makes it."""

    id: int
    event_id: str
    destination: str
    key: str | None
    body: bytes
    headers: Any
    attempts: int


class Candidate(NamedTuple):
    """A row the second pass's scan found, as the direct path makes it."""

    id: int
    key: str | None


class RelayStatements:
    def __init__(
        self, tables: Tables, dialect: str, *, engine_dialect: Dialect | None = None
    ) -> None:
        """``engine_dialect``: the engine's own, to send the round's statements straight to
        psycopg (db.direct) where it can; without it they all go through SQLAlchemy."""
        self.table = ob = tables.outbox
        self.postgres = dialect == "postgresql"
        self.mysql = is_mysql(dialect)
        # A key is held back from its oldest row that failed and cannot go now (backing
        # off, or parked): its events leave in the order they were added. Only rows
        # that failed before (attempts > 0) can hold a key back, and they are few. Parked
        # is stored on the row (parked_at), whatever this relay's max_attempts; an
        # abandoned row never goes and holds nothing back.
        parked = ob.c.parked_at.is_not(None)
        live = (ob.c.published_at.is_(None), ob.c.abandoned_at.is_(None))
        blocked = (
            select(ob.c.key, func.min(ob.c.id).label("from_id"))
            .where(
                *live,
                ob.c.attempts > 0,
                ob.c.key.is_not(None),
                or_(ob.c.available_at > bindparam("now"), parked),
            )
            .group_by(ob.c.key)
            .cte("blocked")
        )
        held_back = exists().where(blocked.c.key == ob.c.key, blocked.c.from_id < ob.c.id)
        may_go = (
            *live,
            ob.c.parked_at.is_(None),
            # A fresh row may always go: its available_at is only the writer's clock.
            or_(ob.c.attempts == 0, ob.c.available_at <= bindparam("now")),
            ~held_back,
        )
        self._candidates = (
            select(ob.c.id, ob.c.key).where(*may_go).order_by(ob.c.id).limit(bindparam("limit"))
        )
        # Asked again once the rows' keys are locked: between the scan and the lock another
        # relay may have published, backed off or parked a row, or held its key back.
        columns = (
            ob.c.id,
            ob.c.event_id,
            ob.c.destination,
            ob.c.key,
            ob.c.body,
            ob.c.headers,
            ob.c.attempts,
        )
        rows = select(*columns).where(self._in_ids(), *may_go)
        self._rows = rows.order_by(ob.c.id)
        if self.mysql:
            # MySQL and MariaDB: no advisory locks. A round row-locks the scan's rows in id
            # order, SKIP LOCKED, at most a batch of them; each key goes from its oldest row
            # the scan found, and a key any of whose older rows the lock did not bring back
            # (another relay holds it, or it changed since the scan) waits from there
            # (_in_key_order). Another relay holding a key holds its oldest rows, which every
            # scan finds first. The conditions are asked again of the locked rows (a locking
            # read sees the latest version), but not the hold-back: a key can only become
            # held back through an older row of it, which the scan found and the lock then
            # did not bring back. No subquery: MySQL locks what a locking read's subqueries
            # read too, and SKIP LOCKED would skip there.
            self._rows = (
                select(*columns)
                .where(
                    self._in_ids(),
                    *live,
                    ob.c.parked_at.is_(None),
                    or_(ob.c.attempts == 0, ob.c.available_at <= bindparam("now")),
                )
                .order_by(ob.c.id)
                .limit(bindparam("limit"))
                .with_for_update(skip_locked=True)
                # By the primary key alone: through a secondary index MariaDB locks the index
                # entry, then waits (SKIP LOCKED or not) for the row another relay holds,
                # and that relay's UPDATE waits for the entry: a deadlock (seen, 10.11).
                .with_hint(ob, "FORCE INDEX (PRIMARY)")
            )
        if self.postgres:
            self._rows = self._rows.with_for_update(skip_locked=True, of=ob)
            keys = (
                func.unnest(bindparam("keys", type_=ARRAY(Text)))
                .table_valued("k")
                .render_derived(name="keys")
            )
            space = locks.space(locks.RELAY, ob)
            self._lock_keys = select(keys.c.k).where(
                func.pg_try_advisory_xact_lock(space, func.hashtext(keys.c.k))
            )
            # The first pass claims in one statement: a batch of rows that may go (scan),
            # each of their keys tested once (MATERIALIZED: one answer per key, so no later
            # row of a key passes after an earlier one failed), and the rows of the keys
            # this transaction locked, row-locked (no row of a key another relay holds is
            # locked here).
            scan = select(ob.c.id, ob.c.key).where(*may_go).order_by(ob.c.id)
            scan_cte = scan.limit(bindparam("limit")).cte("scan").prefix_with("MATERIALIZED")
            distinct_keys = select(scan_cte.c.key).where(scan_cte.c.key.is_not(None)).distinct()
            tried = distinct_keys.subquery("tried")
            locked = (
                select(tried.c.key)
                .where(func.pg_try_advisory_xact_lock(space, func.hashtext(tried.c.key)))
                .cte("locked")
                .prefix_with("MATERIALIZED")
            )
            # As one array (an InitPlan), so the rows are fetched by primary key, not by a
            # hash join over the whole table (the planner cannot estimate the CTEs).
            mine = (
                select(func.array_agg(scan_cte.c.id))
                .where(or_(scan_cte.c.key.is_(None), scan_cte.c.key.in_(select(locked.c.key))))
                .scalar_subquery()
            )
            scanned = select(func.count()).select_from(scan_cte).scalar_subquery()
            first = select(func.min(scan_cte.c.id)).scalar_subquery()
            self._claim_locked = (
                select(*columns, scanned.label("scanned"), first.label("first"))
                .where(
                    ob.c.id == any_(cast(mine, ARRAY(BigInteger))),
                    *live,
                    ob.c.parked_at.is_(None),
                    or_(ob.c.attempts == 0, ob.c.available_at <= bindparam("now")),
                )
                .order_by(ob.c.id)
                .with_for_update(skip_locked=True, of=ob)
            )
            # Asked in a statement of its own, whose snapshot follows the locks: the rows of
            # the claimed keys, within the scan, that did not come back. A relay that held a
            # key until a moment ago may have backed off or parked an older row of it; and
            # SKIP LOCKED passes over a row another transaction holds locked (the
            # application's FOR UPDATE or FOR KEY SHARE of a foreign key, an operator's
            # UPDATE) while the key's later rows come back. Either way the key's rows after
            # it wait for the next round.
            self._blocked_now = (
                select(ob.c.key, func.min(ob.c.id))
                .where(
                    *live,
                    ob.c.key == any_(bindparam("keys", type_=ARRAY(Text))),
                    ob.c.id >= bindparam("first"),
                    ob.c.id < bindparam("below"),
                    ob.c.id != all_(bindparam("ids", type_=ARRAY(BigInteger))),
                )
                .group_by(ob.c.key)
            )
        self._published = (
            update(ob).where(self._in_ids()).values(published_at=bindparam("now"), last_error=None)
        )
        self._delete = delete(ob).where(self._in_ids())
        # The failure that reaches max_attempts parks the row, in the same UPDATE (the
        # count in the row decides, not the one this relay read).
        parks = ob.c.attempts + 1 >= bindparam("max_attempts")
        self._failed = (
            update(ob)
            .where(ob.c.id == bindparam("row_id"))
            # In this order: MySQL assigns left to right, each later expression seeing the
            # columns already set, so attempts goes last (the park asks the count before it).
            .ordered_values(
                (ob.c.parked_at, case((parks, bindparam("now")), else_=ob.c.parked_at)),
                (ob.c.parked_reason, case((parks, bindparam("reason")), else_=ob.c.parked_reason)),
                (ob.c.available_at, bindparam("available_at")),
                (ob.c.last_error, bindparam("error")),
                (ob.c.attempts, ob.c.attempts + 1),
            )
        )
        self._backlog = select(func.count()).where(*live, ob.c.parked_at.is_(None))
        self._parked = (
            select(ob.c.event_id, ob.c.last_error).where(and_(*live, parked)).order_by(ob.c.id)
        )

        # The statements of every round, straight to psycopg (SQLAlchemy's path otherwise),
        # their rows in binary format (measured on a round of 500 256-byte events: 0.35 ms
        # less server CPU and 0.4 ms less here than text), a list of ids sent in binary.
        def built(statement: Any, given: tuple[str, ...], row: Any = None) -> direct.Direct:
            if engine_dialect is None or not self.postgres:
                return direct.Direct(statement)
            ids = ("ids",) if "ids" in given else ()
            return direct.compile_direct(
                statement, engine_dialect, given, row, binary=True, binary_params=ids
            )

        if self.postgres:
            self._claim_direct = built(self._claim_locked, ("now", "limit"), Claimed._make)
            self._blocked_direct = built(self._blocked_now, ("keys", "first", "below", "ids"))
            self._lock_keys_direct = built(self._lock_keys, ("keys",))
        # The second pass also runs at the end of every drain (the empty round asks it).
        self._candidates_direct = built(self._candidates, ("now", "limit"), Candidate._make)
        self._rows_direct = built(self._rows, ("ids", "now"), Fetched._make)
        self._published_direct = built(self._published, ("ids", "now"))
        self._delete_direct = built(self._delete, ("ids",))

    def _in_ids(self) -> Any:
        """``id IN (:ids)``; on PostgreSQL one array parameter, so the statement text (and
        its server-side plan) stays the same whatever the number of ids."""
        if self.postgres:
            return self.table.c.id == any_(bindparam("ids", type_=ARRAY(BigInteger)))
        return self.table.c.id.in_(bindparam("ids", expanding=True))

    def claim(self, conn: Connection, now: datetime, limit: int) -> list[Any]:
        """Rows this relay alone may publish now, in id order, locked until commit.

        PostgreSQL, first pass: one claiming statement over a batch's worth of rows, then
        the keys' hold-backs asked again; a relay alone is done then. When other relays
        hold some of those keys, a second pass scans ``WINDOW`` batches, so relays side by
        side take the next keys instead of going home empty."""
        if self.mysql:
            return self._claim_mysql(conn, now, limit)
        if self.postgres:
            rows = self._first_pass(conn, now, limit)
            if rows and len(rows) >= min(limit, rows[0].scanned):
                return rows  # a full batch, or every row the scan found
            mine = {row.key for row in rows if row.key is not None}
        params = {"now": now, "limit": limit * WINDOW if self.postgres else limit}
        candidates = direct.rows(conn, self._candidates_direct, params)
        if self.postgres:
            candidates = self._lock_keys_for(conn, candidates, limit, mine)
        candidates = candidates[:limit]
        if not candidates:
            return []
        ids = [row.id for row in candidates]
        rows = direct.rows(conn, self._rows_direct, {"ids": ids, "now": now})
        return _in_key_order(candidates, rows)

    def _claim_mysql(self, conn: Connection, now: datetime, limit: int) -> list[Any]:
        """MySQL: scan ``WINDOW`` batches of rows that may go (no lock), row-lock up to a batch
        of them in id order skipping those another transaction holds, keep each key's rows
        up to its first gap. The round's transaction runs at READ COMMITTED (relay.py): each
        statement sees the latest commits, and a row the lock looked at and left takes no
        lock."""
        for window in (1, WINDOW):
            scanned = {"now": now, "limit": limit * window}
            candidates = direct.rows(conn, self._candidates_direct, scanned)
            if not candidates:
                return []
            ids = [row.id for row in candidates]
            rows = direct.rows(conn, self._rows_direct, {"ids": ids, "now": now, "limit": limit})
            if len(rows) >= min(limit, len(candidates)):
                break  # a full batch, or every row the scan found: a relay alone stops here
            # Other relays hold some of these rows: look further for keys nobody holds (the
            # rows locked already are this transaction's, and come back again).
        return _in_key_order(candidates, rows)

    def _first_pass(self, conn: Connection, now: datetime, limit: int) -> list[Any]:
        rows = direct.rows(conn, self._claim_direct, {"now": now, "limit": limit})
        if not rows or len(rows) == rows[0].scanned:
            # Every row the scan saw came back locked and still free to go, so no relay
            # changed one of them after the scan's snapshot. A relay that held one of these
            # keys until a moment ago could only hold the key back by failing an older
            # row of it, one that was free in that snapshot, so in the scan too, and the
            # row lock would then have dropped it (its new version no longer may go).
            return rows
        if keys := sorted({row.key for row in rows if row.key is not None}):
            asked = {
                "keys": keys,
                "first": rows[0].first,
                "below": rows[-1].id,
                "ids": [row.id for row in rows],
            }
            blocked = dict(direct.rows(conn, self._blocked_direct, asked))
            if blocked:  # rare: a row of these keys failed or was locked since the scan
                rows = [r for r in rows if r.key not in blocked or r.id < blocked[r.key]]
        return rows

    def _lock_keys_for(
        self, conn: Connection, candidates: list[Any], limit: int, mine: set[str]
    ) -> list[Any]:
        """Lock keys in order of their oldest row until they cover ``limit`` rows (``mine``:
        the keys held already; it gains the new ones)."""
        per_key: dict[str, int] = {}
        loose = 0
        for row in candidates:
            if row.key is None:
                loose += 1
            else:
                per_key[row.key] = per_key.get(row.key, 0) + 1
        covered = loose + sum(count for key, count in per_key.items() if key in mine)
        waiting = (key for key in per_key if key not in mine)  # first appearance: id order
        for _ in range(LOCK_TRIES):
            asking: list[str] = []
            asked = 0  # rows of the keys in ``asking``: running sums, not a sum per key
            while covered + asked < limit and (key := next(waiting, None)) is not None:
                asking.append(key)
                asked += per_key[key]
            if not asking:
                break
            got = {row[0] for row in direct.rows(conn, self._lock_keys_direct, {"keys": asking})}
            mine |= got
            covered += sum(per_key[k] for k in got)
        return [row for row in candidates if row.key is None or row.key in mine]

    def mark_published(
        self, conn: Connection, ids: Sequence[int], now: datetime, delete_rows: bool
    ) -> None:
        if not ids:
            return
        if delete_rows:
            direct.run(conn, self._delete_direct, {"ids": list(ids)})
        else:
            direct.run(conn, self._published_direct, {"ids": list(ids), "now": now})

    def mark_failed(
        self,
        conn: Connection,
        row_id: int,
        retry_at: datetime,
        error: str,
        *,
        now: datetime,
        max_attempts: int,
        reason: str,
    ) -> None:
        """One more failed attempt; the one that reaches ``max_attempts`` parks the row
        (``parked_at = now``, ``parked_reason = reason``)."""
        params = {"row_id": row_id, "available_at": retry_at, "error": error}
        params.update(now=now, max_attempts=max_attempts, reason=reason)
        conn.execute(self._failed, params)

    def backlog(self, conn: Connection) -> int:
        """Unpublished rows that are neither parked nor abandoned."""
        return int(conn.execute(self._backlog).scalar_one())

    def parked(self, conn: Connection) -> list[tuple[str, str | None]]:
        """(event_id, last_error) of the parked rows, in id order."""
        return [(event_id, error) for event_id, error in conn.execute(self._parked)]


def _in_key_order(candidates: Sequence[Any], rows: list[Any]) -> list[Any]:
    """``rows`` without a key's rows after the first of its ``candidates`` that did not come
    back: the fetch skips a row another transaction holds locked (SKIP LOCKED), or one
    no longer free to go, while the key's later rows come back; they wait for it."""
    if len(rows) == len(candidates):
        return rows
    back = {row.id for row in rows}
    gap: dict[str, int] = {}
    for row in candidates:
        if row.key is not None and row.id not in back:
            gap.setdefault(row.key, row.id)
    return [r for r in rows if r.key is None or r.key not in gap or r.id < gap[r.key]]
