"""The SQL store's statements, and its claim as steps: one set for the blocking and asyncio stores.

``claim_steps`` yields (statement, params) pairs and is sent each one's rows;
it returns the ClaimResult. It is the same for a claim committed on its own
(with a lease) and for one inside the request's transaction (no lease: the
row lock is the lease, see TransactionalStore). PostgreSQL's one-round-trip claim
statements are in sql_postgres.py.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Generator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import and_, bindparam, delete, or_, select, update
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.sql import Executable
from sqlalchemy.sql.elements import TextClause

from ..db.dialects import require_supported
from ..schema import Tables
from .sql_pipeline import LOST
from .sql_postgres import guarded_complete, trying_claim, waiting_claim
from .store import Claimed, ClaimResult, Completed, InFlight, Mismatch
from .stored import CorruptStoredResponse, StoredResponse

IN_FLIGHT = "in_flight"
COMPLETED = "completed"
NOT_STORED = "not_stored"
_ATTEMPTS = 3  # a record can vanish between our INSERT and SELECT (its claim released)

Step = tuple[Executable, dict[str, Any]]


def new_token() -> str:
    return secrets.token_hex(16)


def aware(moment: datetime | None) -> datetime | None:
    """SQLite gives back naive datetimes; ours are always UTC."""
    if moment is not None and moment.tzinfo is None:
        return moment.replace(tzinfo=UTC)
    return moment


class KeyStatements:
    """Statements over one idempotency_keys table for one dialect; built once."""

    def __init__(self, tables: Tables, dialect: str) -> None:
        require_supported(dialect)
        self.dialect = dialect
        t = self.table = tables.idempotency_keys
        where_key = and_(t.c.scope == bindparam("b_scope"), t.c.key == bindparam("b_key"))
        mine = and_(where_key, t.c.token == bindparam("b_token"), t.c.state == IN_FLIGHT)
        self.mysql = dialect in ("mysql", "mariadb")
        if self.mysql:
            # No ON CONFLICT DO NOTHING, no RETURNING; never INSERT IGNORE (it turns every
            # error into a warning). A duplicate's no-op UPDATE takes the row's exclusive lock
            # at once (a plain INSERT's duplicate-key error takes a shared one, and two twins
            # upgrading theirs deadlock), and whose row it is is read back by its token: the
            # row count cannot say (SQLAlchemy's MySQL dialects set CLIENT.FOUND_ROWS, so a
            # no-op update counts 1, as an insert does).
            upsert = mysql.insert(t)
            self.insert: Executable = upsert.on_duplicate_key_update(scope=upsert.inserted.scope)
        else:
            insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
            self.insert = (
                insert(t)
                .on_conflict_do_nothing(index_elements=[t.c.scope, t.c.key])
                .returning(t.c.key)
            )
        now: Any = bindparam("b_now")
        # Free to take: a record past its expiry (a new request, whatever its body), or an
        # in-flight claim whose lease ran out (its worker died) for the same request.
        self.reclaim = (
            update(t)
            .where(
                where_key,
                or_(
                    and_(t.c.state != IN_FLIGHT, t.c.expires_at <= now),
                    and_(
                        t.c.state == IN_FLIGHT,
                        t.c.locked_until <= now,
                        t.c.fingerprint == bindparam("b_fingerprint"),
                    ),
                ),
            )
            .values(
                fingerprint=bindparam("b_fingerprint"),
                state=IN_FLIGHT,
                token=bindparam("b_token"),
                locked_until=bindparam("b_locked_until"),
                status=None,
                headers=None,
                body=None,
                created_at=now,
                expires_at=None,
            )
        )
        if not self.mysql:  # MySQL: the row count says (CLIENT.FOUND_ROWS: rows matched)
            self.reclaim = self.reclaim.returning(t.c.key)
        self.read = select(
            t.c.fingerprint,
            t.c.state,
            t.c.locked_until,
            t.c.status,
            t.c.headers,
            t.c.body,
            t.c.expires_at,
            t.c.token,
        ).where(where_key)
        finish: dict[str, Any] = {
            "state": bindparam("b_state"),
            "status": bindparam("b_status"),
            "headers": bindparam("b_headers"),
            "body": bindparam("b_body"),
            "expires_at": bindparam("b_expires_at"),
            "token": None,
            "locked_until": None,
        }
        self.complete = update(t).where(mine).values(**finish)
        self.complete_in = update(t).where(where_key, t.c.state == IN_FLIGHT).values(**finish)
        self.renew = update(t).where(mine).values(locked_until=bindparam("b_locked_until"))
        self.release = delete(t).where(mine)
        self.waiting: tuple[Executable, Executable, Executable] | None = None
        self.trying: Executable | None = None
        self.claim_one: Executable | None = None
        self.guarded_complete: TextClause | None = None
        if dialect == "postgresql":
            self.guarded_complete = guarded_complete(t, LOST)
            self.waiting = waiting_claim(t, self.insert, self.reclaim)
            self.trying = trying_claim(t)
            self.claim_one = trying_claim(t, lock=False)

    def claim_steps(
        self,
        scope: str,
        key: str,
        fingerprint: str,
        now: datetime,
        lease: timedelta | None,
        wait: timedelta | None = None,
        *,
        alone: bool = False,
    ) -> Generator[Step, Sequence[Any], ClaimResult]:
        """The claim; inside the request's transaction the row lock holds it, and ``lease``
        only frees a claim row committed without its response (None: never).

        ``wait`` (PostgreSQL, inside the request's transaction): the claim waits at most this
        long on a twin's row lock; lock_timeout is set for the claim and restored by whichever
        statement claims, in the same round trips (see sql_postgres.waiting_claim)."""
        token = new_token()
        locked_until = now + lease if lease is not None else None
        params: dict[str, Any] = {"b_scope": scope, "b_key": key, "b_fingerprint": fingerprint}
        params |= {"b_now": now, "b_token": token, "b_locked_until": locked_until}
        row: dict[str, Any] = {"scope": scope, "key": key, "fingerprint": fingerprint}
        row["state"] = IN_FLIGHT
        row |= {"token": token, "locked_until": locked_until, "created_at": now}
        if self.mysql:
            return (yield from self._mysql_claim(row, params, fingerprint, now))
        insert: Executable = self.insert
        again: Executable = self.insert
        reclaim: Executable = self.reclaim
        insert_first = True
        one = self.trying if wait is not None and not wait else None
        if wait is None and alone:
            one = self.claim_one
        if one is not None:
            # One statement: (in the request's transaction, no wait: take the key's advisory
            # lock without waiting,) insert the claim, and read a record already there.
            found = yield one, row
            tried = found[0]
            if not tried.got:
                # Held by a twin in its open transaction, or by another retry reading the
                # finished record: that record, if there is one, answers (concurrent replays
                # must not refuse each other).
                if tried.state in (COMPLETED, NOT_STORED) and not _free(tried, fingerprint, now):
                    return judge(tried, fingerprint, now)
                return InFlight(1.0)
            if tried.claimed:
                return Claimed(token)
            if tried.state is not None and not _free(tried, fingerprint, now):
                return judge(tried, fingerprint, now)
            insert_first = False  # a record to take over, or one committed after our snapshot
        elif wait is not None and self.waiting is not None:
            insert, again, reclaim = self.waiting
            row["b_wait"] = lock_wait(wait)
        for _ in range(_ATTEMPTS):
            if insert_first and (yield insert, row):
                return Claimed(token)
            insert_first = True
            insert = again  # lock_timeout is saved once, and stays set until a claim restores it
            if (yield reclaim, params):
                return Claimed(token)
            found = yield self.read, {"b_scope": scope, "b_key": key}
            if found:
                return judge(found[0], fingerprint, now)
        return InFlight(1.0)

    def _mysql_claim(
        self, row: dict[str, Any], params: dict[str, Any], fingerprint: str, now: datetime
    ) -> Generator[Step, Sequence[Any], ClaimResult]:
        """MySQL, MariaDB: the claim row inserted, or the record there locked exclusively
        (a twin in its open transaction makes this wait, up to the lock wait timeout), then
        read: our token means ours; a free record (expired, or a lapsed lease of this
        request) is taken over under that lock; anything else is judged."""
        yield self.insert, row
        # A locking read: the latest version whatever the snapshot (the lock is ours already).
        found = yield self.read.with_for_update(), {"b_scope": row["scope"], "b_key": row["key"]}
        if not found:  # cannot be: the row is locked by us; fail closed, as a twin
            return InFlight(1.0)
        record = found[0]
        if record.token == row["token"]:
            return Claimed(row["token"])
        if _free(record, fingerprint, now) and (yield self.reclaim, params):
            return Claimed(row["token"])
        return judge(record, fingerprint, now)

    def finish_params(
        self, scope: str, key: str, response: StoredResponse, expires_at: datetime
    ) -> dict[str, Any]:
        return {
            "b_scope": scope,
            "b_key": key,
            "b_state": COMPLETED if response.replayable else NOT_STORED,
            "b_status": response.status,
            "b_headers": [list(pair) for pair in response.headers],
            "b_body": response.body,
            "b_expires_at": expires_at,
        }


def _free(row: Any, fingerprint: str, now: datetime) -> bool:
    """A record the reclaim UPDATE may take: expired, or a lapsed claim of this request."""
    if row.state != IN_FLIGHT:
        expires = aware(row.expires_at)
        return expires is not None and expires <= now
    until = aware(row.locked_until)
    return until is not None and until <= now and row.fingerprint == fingerprint


def judge(row: Any, fingerprint: str, now: datetime) -> ClaimResult:
    """What a live record someone else holds means for this request."""
    if row.fingerprint != fingerprint:
        return Mismatch()
    if row.state == IN_FLIGHT:
        until = aware(row.locked_until)
        left = (until - now).total_seconds() if until is not None else 1.0
        return InFlight(max(left, 0.0))
    if row.state not in (COMPLETED, NOT_STORED):
        raise CorruptStoredResponse(f"idempotency record in unknown state {row.state!r}")
    if row.state == NOT_STORED:
        return Completed(StoredResponse.unreplayable(int(row.status)))
    try:
        headers = tuple((str(n), str(v)) for n, v in row.headers)
    except (TypeError, ValueError) as error:
        raise CorruptStoredResponse(f"stored headers unreadable: {error}") from None
    return Completed(StoredResponse(int(row.status), headers, bytes(row.body or b"")))


def mysql_lock_wait(wait: timedelta, mariadb: bool) -> int:
    """innodb_lock_wait_timeout for a transactional claim: whole seconds, rounded up (MySQL
    has no finer one); 0 (no wait) on MariaDB, at least 1 on MySQL, which refuses 0."""
    return max(0 if mariadb else 1, math.ceil(wait.total_seconds()))


def lock_wait(wait: timedelta) -> str:
    """PostgreSQL lock_timeout for a transactional claim: 0 would mean forever, so at least 1 ms."""
    return f"{max(1, round(wait.total_seconds() * 1000))}ms"


def is_lock_timeout(error: BaseException) -> bool:
    """The twin's claim waited past its budget: PostgreSQL 55P03, SQLite's busy timeout,
    MySQL's and MariaDB's lock wait timeout (1205; NOWAIT's 3572 on MySQL)."""
    orig = getattr(error, "orig", error)
    if getattr(orig, "sqlstate", None) == "55P03":
        return True
    code = orig.args[0] if isinstance(orig, Exception) and orig.args else None
    if type(orig).__module__.startswith(("pymysql", "aiomysql", "asyncmy")) and code in (
        1205,
        3572,
    ):
        return True
    return getattr(orig, "sqlite_errorname", None) in ("SQLITE_BUSY", "SQLITE_LOCKED") or (
        "database is locked" in str(orig)
    )
