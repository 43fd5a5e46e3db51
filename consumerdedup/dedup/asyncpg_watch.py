"""asyncpg under the handler guard, and the pipeline's COMMIT on asyncpg, verified.

asyncpg tells whether a transaction block is open, not whether it was aborted
(db.asyncpg_driver), so what psycopg reads locally is asked of the server here:

- After a handler call that met a database error (``probe``): one statement of ours; an
  aborted transaction refuses it (25P02), and the call is then failed as on psycopg,
  with the error the handler swallowed. A call that met none costs nothing here.
- At the pipeline's COMMIT (``verified_commit``): what SQLAlchemy's adapter sends as
  ``COMMIT;`` goes out as ``SAVEPOINT ...; COMMIT`` in the same round trip (one simple
  query). PostgreSQL refuses the SAVEPOINT in an aborted transaction (25P02) and outside
  any (25P01), and the COMMIT's tag must be ``COMMIT``: so an error nobody saw (a
  statement sent below the guard) never lets the transaction pass for committed. Nothing
  is then committed and the attempt fails (TransactionBroken).

While a handler runs, asyncpg's connection is the one a handler can reach without
SQLAlchemy (``driver_connection``, ``await conn.get_raw_connection()``): its class is
swapped for the call (``watch_asyncpg``) to a subclass of the same layout whose methods
that send SQL (``execute``, ``fetch*``, ``prepare``, ``cursor``, ``copy_*``) have the
text checked before it is sent (transaction control refused, savepoints followed), the
error kept and the state read after it, as psycopg's watched cursors do (raw_commit).
SQLAlchemy's own statements are watched through its cursor events (guard_listeners):
while one of them runs in the pipeline's task, the swapped methods let the adapter's
calls through (its prepare, its BEGIN). The adapter's ``commit()`` is refused, and its
``rollback()`` (SQLAlchemy's rollback and close go through it) is allowed from the
pipeline's thread and task only, as psycopg's raw ``rollback()`` is.

Not watched: asyncpg's protocol object itself and a PreparedStatement a handler made
before the call; an error there is caught by the COMMIT's statement (its whole
transaction then fails, and the span halves to the culprit as for any failed COMMIT).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from ..errors import CommitInHandler, ConfigurationError, TransactionBroken
from .search_path import send_first_asyncpg

try:
    import asyncpg  # type: ignore[import-untyped]
except ImportError:  # pragma: no cover - asyncpg is an extra
    asyncpg = None

_ABORTED = "25P02"  # in_failed_sql_transaction
_NO_TRANSACTION = "25P01"  # no_active_sql_transaction
_VERIFIED_COMMIT = "SAVEPOINT consumerdedup_verify; COMMIT"
"""One simple query: the SAVEPOINT fails in an aborted transaction or outside one, and
the COMMIT then never runs; else the COMMIT commits (the savepoint with it)."""
_PROBE = "SELECT 1"

_CURSOR_PATH = (
    "asyncpg: a cursor of the handler's whose statement needs the search_path read or set "
    "first (it may change the path, or the handler changed it before): a cursor factory "
    "sends nothing at the call, so the guard cannot; use fetch() for that statement"
)
_NOTHING = (
    "the pipeline's COMMIT found no transaction: it was rolled back before the COMMIT "
    "reached the server (a thread or task of a handler still using the raw connection?): "
    "nothing of it committed, nothing is reported done"
)
_BROKEN = (
    "the pipeline's COMMIT found the transaction aborted (a statement sent below the guard, "
    "through asyncpg's protocol or a prepared statement, failed?): nothing of it committed"
)


class RawWatch(Protocol):
    """What a HandlerCall does around a statement sent through asyncpg's connection."""

    def in_cursor(self) -> bool:
        """SQLAlchemy's cursor is running a statement in this task: the adapter's calls."""

    def permitted(self) -> bool:
        """The adapter's own rollback() is under way (allowed: refuse_foreign_rollback)."""

    def permit(self, allowed: bool) -> None:
        """The adapter's rollback() begins (True) or is over (False)."""

    def before_raw(self, sql: str) -> Any:
        """Before ``sql`` is sent on asyncpg's connection: raise to refuse it; send back a
        statement of ours to send first (search_path.PathKeeper), or None."""

    def sent_first(self, first: Any, value: Any) -> None:
        """What ``first`` read (search_path.send_first_asyncpg)."""

    def failed_raw(self, error: BaseException) -> None:
        """asyncpg raised ``error`` for it (it is raised on after this)."""

    def after_sql(self) -> None:
        """After a statement returned: raise if it ended the transaction."""

    def refuse_raw_end(self, word: str) -> CommitInHandler:
        """Given the adapter's method (``commit``), the error to raise."""

    def refuse_foreign_rollback(self) -> None:
        """Before the adapter's rollback(): raise unless from the pipeline's thread and task."""

    def discard(self) -> None:
        """A statement was refused: the connection is not to be used again (``_refused``)."""


_watches: weakref.WeakKeyDictionary[Any, RawWatch] = weakref.WeakKeyDictionary()
"""asyncpg connection -> the watch of the handler call running on it."""
_commits: weakref.WeakKeyDictionary[Any, list[bool]] = weakref.WeakKeyDictionary()
"""asyncpg connection -> [whether the COMMIT went out] during the pipeline's commit."""
_TEXT_FIRST = ("execute", "executemany", "fetch", "fetchval", "fetchrow", "fetchmany", "prepare")
_COPY = ("copy_from_query",)
_TABLE = ("copy_from_table", "copy_to_table", "copy_records_to_table")
_watched_classes: dict[type, type] = {}
_committing_classes: dict[type, type] = {}


def is_asyncpg(raw: object) -> bool:
    return asyncpg is not None and isinstance(raw, asyncpg.Connection)


def watch_asyncpg(adapter: Any, raw: Any, watch: RawWatch) -> Callable[[], None]:
    """Guard ``raw`` (asyncpg's connection) and ``adapter`` (SQLAlchemy's DB-API connection
    over it) for a handler call; send back what puts both back as they were."""
    if raw in _watches:  # a handler running another deduplicator's handler on it
        raise ConfigurationError(
            "asyncpg: a handler call is already guarded on this connection (a handler that "
            "runs another deduplicator's handler on the session it was handed): give the "
            "inner deduplicator a session of its own"
        )
    raw_before, adapter_before = type(raw), type(adapter)
    _swap(raw, _watched_class(raw_before))
    try:
        _swap(adapter, _adapter_class(adapter_before))
    except ConfigurationError:
        raw.__class__ = raw_before
        raise
    _watches[raw] = watch

    def unlock() -> None:
        _watches.pop(raw, None)
        raw.__class__ = raw_before
        adapter.__class__ = adapter_before

    return unlock


def _swap(target: Any, kind: type) -> None:
    try:
        target.__class__ = kind
    except TypeError as exc:  # a connection_class= of another layout
        raise ConfigurationError(
            f"asyncpg: {type(target).__name__} cannot be watched while a handler runs ({exc}); "
            "use asyncpg's own Connection class (no connection_class=)"
        ) from exc


def _watched_class(base: type) -> type:
    kind = _watched_classes.get(base)
    if kind is None:
        namespace: dict[str, Any] = {"__slots__": ()}
        for name in _TEXT_FIRST + _COPY:
            namespace[name] = _sending(base, name, "query", "command")
        for name in _TABLE:
            namespace[name] = _sending(base, name, "table_name", prefix="COPY ")
        namespace["cursor"] = _lazy_cursor(base)
        kind = _watched_classes[base] = type(base)(base.__name__, (base,), namespace)
    return kind


def _sending(base: type, name: str, *keywords: str, prefix: str = "") -> Any:
    """``base.name`` checked first: its SQL is its first argument, given by position or by
    one of ``keywords`` (``execute(query="COMMIT")``)."""
    parent = getattr(base, name)

    def text(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        given = args[0] if args else next((kwargs[k] for k in keywords if k in kwargs), "")
        return prefix + str(given)

    async def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        watch = _watches.get(self)
        if watch is None or watch.in_cursor():
            return await parent(self, *args, **kwargs)
        if watch.permitted():  # the adapter's rollback: its ROLLBACK alone
            return await parent(self, *args, **kwargs)
        first = _refused(watch, text(args, kwargs))
        if first is not None:
            watch.sent_first(first, await send_first_asyncpg(self, first))
        try:
            result = await parent(self, *args, **kwargs)
        except Exception as error:
            watch.failed_raw(error)
            raise
        watch.after_sql()
        return result

    checked.__name__ = name
    return checked


def _lazy_cursor(base: type) -> Any:
    parent = base.cursor  # type: ignore[attr-defined]

    def cursor(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        watch = _watches.get(self)
        # A cursor factory sends nothing at the call: no statement of ours can go first.
        if watch is not None and not watch.in_cursor() and _refused(watch, str(query)):
            watch.discard()
            raise TransactionBroken(_CURSOR_PATH)
        return parent(self, query, *args, **kwargs)

    return cursor


def _refused(watch: RawWatch, sql: str) -> Any:
    """``watch.before_raw(sql)``; if it refuses, the connection is discarded as well: the
    refused COMMIT may come from asyncpg's Transaction object SQLAlchemy's adapter holds,
    which then counts itself failed and rolls nothing back, so the connection would go back
    to the pool inside the server's transaction (every later BEGIN refused by asyncpg)."""
    try:
        return watch.before_raw(sql)
    except Exception:
        watch.discard()
        raise


def _adapter_class(base: type) -> type:
    kind = _watched_classes.get(base)
    if kind is None:
        parent_rollback = base.rollback  # type: ignore[attr-defined]

        def commit(self: Any) -> None:
            watch = _watches.get(self.driver_connection)
            if watch is not None:
                raise watch.refuse_raw_end("commit")
            base.commit(self)  # type: ignore[attr-defined]

        def rollback(self: Any) -> None:
            watch = _watches.get(self.driver_connection)
            if watch is None:
                parent_rollback(self)
                return
            watch.refuse_foreign_rollback()
            watch.permit(True)
            try:
                parent_rollback(self)
            finally:
                watch.permit(False)

        namespace = {"__slots__": (), "commit": commit, "rollback": rollback}
        kind = _watched_classes[base] = type(base)(base.__name__, (base,), namespace)
    return kind


async def probe(raw: Any) -> bool:
    """Whether the server refuses a statement of ours as in an aborted transaction (one
    round trip; asyncpg's own execute, never the watched one)."""
    try:
        await asyncpg.Connection.execute(raw, _PROBE)
    except asyncpg.PostgresError as error:
        if getattr(error, "sqlstate", None) == _ABORTED:
            return True
        raise
    return False


@contextlib.contextmanager
def verified_commit(raw: Any) -> Iterator[None]:
    """Around the pipeline's ``session.commit()`` on asyncpg: the adapter's ``COMMIT;``
    goes out with the SAVEPOINT that verifies it (module doc); nothing else is touched."""
    before = type(raw)
    _swap(raw, _committing_class(before))
    sent = _commits[raw] = [False]
    try:
        yield
    finally:
        _commits.pop(raw, None)
        raw.__class__ = before
    if not sent[0]:  # SQLAlchemy's adapter held no transaction: it sent nothing
        raise TransactionBroken(_NOTHING)


def _committing_class(base: type) -> type:
    kind = _committing_classes.get(base)
    if kind is None:
        parent = base.execute  # type: ignore[attr-defined]

        async def execute(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
            sent = _commits.get(self)
            if sent is None or args or not _is_commit(query):
                return await parent(self, query, *args, **kwargs)
            sent[0] = True
            try:
                status = await parent(self, _VERIFIED_COMMIT, **kwargs)
            except asyncpg.PostgresError as error:
                state = getattr(error, "sqlstate", None)
                if state not in (_ABORTED, _NO_TRANSACTION):
                    raise  # the COMMIT's own error (a deferred constraint): as it is
                if self.is_in_transaction():  # aborted: end it here, SQLAlchemy forgets it
                    await parent(self, "ROLLBACK")
                raise TransactionBroken(_BROKEN if state == _ABORTED else _NOTHING) from error
            if status != "COMMIT":
                raise TransactionBroken(_BROKEN)
            return status

        namespace = {"__slots__": (), "execute": execute}
        kind = _committing_classes[base] = type(base)(base.__name__, (base,), namespace)
    return kind


def _is_commit(query: object) -> bool:
    return isinstance(query, str) and query.strip().rstrip(";").strip().upper() == "COMMIT"
