"""Refusing the raw DB-API connection's ``commit()``, and a COMMIT sent as SQL through it,
while a handler runs.

Caught only afterwards, a raw commit would already have committed the batch's
claims (claim-first: every message of the call reported DUPLICATE, its effects
never written) or its handlers' effects without their records (check-first: run
again). A rollback loses nothing, and SQLAlchemy's own rollback goes through
the raw connection: it is caught afterwards (handler_guard). psycopg's and
aiosqlite's ``commit`` is replaced on the instance for the call; sqlite3's
methods cannot be replaced, so its authorizer denies COMMIT instead (any
authorizer of the application's on that connection is removed). A driver
connection that takes neither is refused: the guard cannot hold on it.

Transaction-control SQL through the raw connection (``execute("COMMIT")``): SQLite's
authorizer denies it on both drivers (aiosqlite's sqlite3 connection gets the same
authorizer); psycopg's cursors, which its ``execute()`` uses too, are made for the call
from a subclass of the connection's ``cursor_factory`` that reads each statement's text
(db.control_sql) before sending it. Not refused: libpq itself (``pgconn.exec_``).
"""

from __future__ import annotations

import inspect
import sqlite3
from collections.abc import Callable
from typing import Any

from ..db.control_sql import transaction_control
from ..errors import CommitInHandler, ConfigurationError

Refuse = Callable[[str], CommitInHandler]
"""Given the method's name, the error to raise (and the call notes that it happened)."""

_REFUSE = "_consumerdedup_refuse"
"""Set on a psycopg connection while a handler runs: its guarded cursors check only then
(a cursor the handler kept works as before once the call is over)."""
_CURSOR_METHODS = ("execute", "executemany", "stream", "copy")
_guarded: dict[type, type] = {}


def refuse_raw_commit(raw: Any, refuse: Refuse) -> Callable[[], None]:
    """Make ``raw.commit()`` and transaction-control SQL sent through ``raw`` raise
    ``refuse(...)``; send back what lifts that."""
    if isinstance(raw, sqlite3.Connection):
        return _deny_on_sqlite(raw, refuse)
    for word in ("commit",):
        try:
            setattr(
                raw,
                word,
                _refusal(refuse, word, inspect.iscoroutinefunction(getattr(raw, word))),
            )
        except (AttributeError, TypeError) as exc:
            raise ConfigurationError(
                f"{type(raw).__name__}: its {word}() cannot be refused while a handler runs, so "
                "a handler could commit apart from the dedup record; use the DB-API module "
                "its dialect loads itself"
            ) from exc
    lift = _refuse_sql(raw, refuse)

    def unlock() -> None:
        vars(raw).pop("commit", None)
        lift()

    return unlock


def _deny_on_sqlite(raw: sqlite3.Connection, refuse: Refuse) -> Callable[[], None]:
    def authorize(action: int, *args: Any) -> int:
        if action == sqlite3.SQLITE_TRANSACTION and str(args[0]).upper() == "COMMIT":
            refuse("commit")
            return sqlite3.SQLITE_DENY
        return sqlite3.SQLITE_OK

    raw.set_authorizer(authorize)
    return lambda: raw.set_authorizer(None)


def _refuse_sql(raw: Any, refuse: Refuse) -> Callable[[], None]:
    """The driver's own ways to send SQL: denied COMMIT for the call."""
    inner = getattr(raw, "_conn", None)
    if isinstance(inner, sqlite3.Connection):  # aiosqlite: its thread's sqlite3 connection
        try:
            return _deny_on_sqlite(inner, refuse)
        except sqlite3.ProgrammingError as exc:  # made with check_same_thread=True
            raise ConfigurationError(
                f"aiosqlite: a COMMIT sent through the raw connection cannot be refused while "
                f"a handler runs ({exc}); leave check_same_thread to aiosqlite"
            ) from exc
    base = getattr(raw, "cursor_factory", None)
    if not (isinstance(base, type) and hasattr(raw, "pgconn")):
        return lambda: None  # neither psycopg nor aiosqlite: commit() was all it had
    vars(raw)[_REFUSE] = refuse
    raw.cursor_factory = _guarded_cursor(base)

    def lift() -> None:
        vars(raw).pop(_REFUSE, None)
        raw.cursor_factory = base

    return lift


def _guarded_cursor(base: type) -> type:
    """``base`` (a psycopg cursor class) whose statements are read before they are sent."""
    if base in _guarded or getattr(base, "_consumerdedup_guarded", False):
        return _guarded.get(base, base)
    coroutine = inspect.iscoroutinefunction(getattr(base, "execute", None))

    def method(name: str) -> Callable[..., Any]:
        parent = getattr(base, name)

        def checked(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
            _check(self, query, name)
            return parent(self, query, *args, **kwargs)

        async def checked_async(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
            _check(self, query, name)
            return await parent(self, query, *args, **kwargs)

        # stream() and copy() give back an iterator or a context manager: checked at the call.
        return checked_async if coroutine and inspect.iscoroutinefunction(parent) else checked

    namespace: dict[str, Any] = {
        name: method(name) for name in _CURSOR_METHODS if hasattr(base, name)
    }
    namespace["_consumerdedup_guarded"] = True
    _guarded[base] = guarded = type(base.__name__, (base,), namespace)
    return guarded


def _check(cursor: Any, query: Any, name: str) -> None:
    refuse: Refuse | None = vars(cursor.connection).get(_REFUSE)
    if refuse is None:
        return
    if isinstance(query, str):
        sql = query
    elif isinstance(query, bytes | bytearray | memoryview):
        sql = bytes(query).decode("utf-8", "replace")
    elif callable(getattr(query, "as_string", None)):  # psycopg.sql.Composable
        sql = query.as_string(cursor)
    else:
        sql = str(query)
    if transaction_control(sql, "postgresql"):
        raise refuse(name)


def _refusal(refuse: Refuse, word: str, coroutine: bool) -> Callable[..., Any]:
    if coroutine:

        async def refuse_async(*_args: Any, **_kwargs: Any) -> None:
            raise refuse(word)

        return refuse_async

    def refuse_now(*_args: Any, **_kwargs: Any) -> None:
        raise refuse(word)

    return refuse_now
