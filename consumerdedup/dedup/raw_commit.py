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
authorizer); on psycopg, every cursor the connection makes for the call (its
``cursor()``, which its ``execute()`` and SQLAlchemy use, named server-side cursors too,
whatever class ``cursor_factory`` names, even one the handler set) has its class swapped
for a subclass that reads each statement's text (db.control_sql) before sending it. Not
refused: libpq itself (``pgconn.exec_``) and a cursor class instantiated by hand
(``psycopg.Cursor(raw)``); a commit through them is found afterwards (handler_end).

On psycopg those cursors are where the guard watches every statement of the call, the
handler's through SQLAlchemy included (``StatementWatch``): checked before it is sent,
its error kept, the transaction's state read after it. SQLAlchemy's cursor events would
do the same one level up, at about 20 us a statement of event dispatch (measured), and
the text would be read twice; so on psycopg they are not listened for (guard_listeners).
"""

from __future__ import annotations

import functools
import inspect
import sqlite3
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from ..db.control_sql import transaction_control
from ..errors import CommitInHandler, ConfigurationError, TransactionBroken
from .search_path import send_first, send_first_async

Refuse = Callable[[str], CommitInHandler]
"""Given the method's name, the error to raise (and the call notes that it happened)."""


class StatementWatch(Protocol):
    """What a HandlerCall does around each statement sent through a guarded cursor."""

    def refuse_raw_end(self, word: str) -> CommitInHandler:
        """Given the raw method's name (``commit``), the error to raise."""

    def before_sql(self, sql: str, parameters: Any, executemany: bool) -> Any:
        """Before ``sql`` is sent: raise to refuse it; send back a statement of ours to send
        first on the connection (search_path.PathKeeper), or None."""

    def sent_first(self, first: Any, value: Any) -> None:
        """What ``first`` read (search_path.send_first)."""

    def after_sql(self) -> None:
        """After a statement returned: raise if it ended the transaction."""

    def failed_sql(self, error: BaseException) -> None:
        """The driver raised ``error`` for the statement (it is raised on after this)."""

    def savepoint_below(self) -> None:
        """psycopg's ``transaction()`` is entered: a savepoint no cursor sends."""

    def made(self, cursor: Any) -> None:
        """A cursor the connection made while this watch is on (``expire`` at the call's end)."""

    def refuse_foreign_rollback(self) -> None:
        """Before the raw ``rollback()`` runs: raise if a thread or task other than the
        pipeline's calls it (one the handler left running)."""

    def ended_below(self, how: str) -> None:
        """The transaction ended where no statement check sees it (``how``: SQLite's raw
        connection rolled back, or began anew): nothing of the call may commit."""


_WATCH = "_consumerdedup_watch"
"""Set on a psycopg connection while a handler runs: its guarded cursors check only then
(a cursor the handler kept works as before once the call is over)."""
_CURSOR_METHODS = ("execute", "executemany", "stream", "copy")
_LAZY = frozenset({"stream", "copy"})
"""They give back an iterator or a context manager: checked at the call, nothing after."""
_guarded: dict[type, type] = {}


def refuse_raw_commit(raw: Any, watch: StatementWatch) -> tuple[Callable[[], None], bool]:
    """Make ``raw.commit()`` and transaction-control SQL sent through ``raw`` raise
    ``watch.refuse_raw_end(...)``; send back what lifts that, and whether every statement
    of ``raw`` is watched at its cursors (psycopg) from now on."""
    coroutine = _psycopg_commit_kind(raw)
    if coroutine is not None:
        return _watch_psycopg(raw, watch, coroutine), True
    refuse = watch.refuse_raw_end
    if isinstance(raw, sqlite3.Connection):
        return _deny_on_sqlite(raw, watch), False
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
    lift = _refuse_sql(raw, watch)

    def unlock() -> None:
        vars(raw).pop("commit", None)
        for word in _MYSQL_METHODS:
            vars(raw).pop(word, None)
        lift()

    return unlock, False


_psycopg_kinds: dict[type, bool | None] = {}


def _psycopg_commit_kind(raw: Any) -> bool | None:
    """For a psycopg connection, whether its commit() is a coroutine function (the async
    connection's); None for any other driver. Judged once per class."""
    kind = type(raw)
    if kind not in _psycopg_kinds:
        psycopg_like = hasattr(raw, "pgconn") and callable(getattr(raw, "cursor", None))
        commit = getattr(raw, "commit", None)
        _psycopg_kinds[kind] = inspect.iscoroutinefunction(commit) if psycopg_like else None
    return _psycopg_kinds[kind]


def _watch_psycopg(raw: Any, watch: StatementWatch, coroutine: bool) -> Callable[[], None]:
    """A psycopg connection guarded for one call: its commit() refused, and every cursor it
    makes (``cursor()``, which its ``execute()`` and SQLAlchemy use, whatever class the
    handler set as ``cursor_factory``) turned into a watching one. Whatever a call around
    this one had set is put back at the end (a handler that runs another deduplicator's
    handler on the same connection)."""
    own = vars(raw)
    names = ("commit", "cursor", "rollback", "transaction", _WATCH)
    before = tuple(own.get(name) for name in names)
    own["commit"] = functools.partial(_refuse_async if coroutine else _refuse_now, watch)
    own["cursor"] = functools.partial(_watching_cursor, raw)
    # A rollback from a thread the handler left running could land between the check that
    # the transaction is open and one of our statements, which autocommit would then commit
    # alone (a record without its effects): refused from any thread or task but ours.
    own["rollback"] = functools.partial(_rollback_async if coroutine else _rollback_now, raw, watch)
    own["transaction"] = functools.partial(_transaction_watched, raw, watch)
    own[_WATCH] = watch

    def unlock() -> None:
        for name, value in zip(names, before, strict=True):
            if value is None:
                own.pop(name, None)
            else:
                own[name] = value

    return unlock


def _watching_cursor(raw: Any, *args: Any, **kwargs: Any) -> Any:
    """``raw.cursor(...)`` as the driver makes it, its class then swapped for the watching
    subclass of that class (the same layout: no instance state added)."""
    cursor = type(raw).cursor(raw, *args, **kwargs)
    kind = type(cursor)
    guarded = _guarded.get(kind) or _guarded_cursor(kind)
    if guarded is not kind:
        try:
            cursor.__class__ = guarded
        except TypeError as exc:  # a cursor class whose layout cannot take a subclass
            cursor.close()
            raise ConfigurationError(
                f"{kind.__name__}: a cursor of this class cannot be watched while a handler "
                f"runs ({exc}); use psycopg's own cursor classes as the cursor_factory"
            ) from exc
    watch: StatementWatch | None = vars(raw).get(_WATCH)
    if watch is not None:
        watch.made(cursor)
    return cursor


_expired: weakref.WeakSet[Any] = weakref.WeakSet()
"""Cursors made in a handler call that were still open when it ended: a thread or task the
handler left running could send on one later, into whatever transaction the connection is
in then (another message's, the application's). Refused from then on."""
_EXPIRED = (
    "a cursor made in a handler call was used after that call ended (by a thread or task "
    "the handler left running?): refused, as its statement would run in another "
    "transaction; do all of a message's work inside its handler call"
)


def expire(cursors: list[Any]) -> None:
    """The handler call that made ``cursors`` is over: those still open are refused later."""
    for cursor in cursors:
        if not cursor.closed:
            _expired.add(cursor)
    cursors.clear()


def _transaction_watched(raw: Any, watch: StatementWatch, *args: Any, **kwargs: Any) -> Any:
    """psycopg's ``transaction()``: its SAVEPOINT, RELEASE and ROLLBACK TO go out without a
    cursor, unseen; what follows savepoints by their statements is told first."""
    watch.savepoint_below()
    return type(raw).transaction(raw, *args, **kwargs)


def _rollback_now(raw: Any, watch: StatementWatch, *args: Any, **kwargs: Any) -> Any:
    watch.refuse_foreign_rollback()
    return type(raw).rollback(raw, *args, **kwargs)


async def _rollback_async(raw: Any, watch: StatementWatch, *args: Any, **kwargs: Any) -> Any:
    watch.refuse_foreign_rollback()
    return await type(raw).rollback(raw, *args, **kwargs)


def _refuse_now(watch: StatementWatch, *_args: Any, **_kwargs: Any) -> None:
    raise watch.refuse_raw_end("commit")


async def _refuse_async(watch: StatementWatch, *_args: Any, **_kwargs: Any) -> None:
    raise watch.refuse_raw_end("commit")


def _deny_on_sqlite(raw: sqlite3.Connection, watch: StatementWatch) -> Callable[[], None]:
    """sqlite3's authorizer, which sees every statement as it is prepared (the raw
    connection's own, its ``commit()`` and ``rollback()`` too, but not a cached statement
    run again). While the guard is on, the pipeline's transaction is the only one a
    statement may run in: COMMIT is denied; a ROLLBACK tells ``watch`` that it is over;
    and once it is over, however it ended (a ROLLBACK, or one no statement names: an
    ``OR ROLLBACK`` conflict, a trigger's ``RAISE(ROLLBACK)``), every statement is denied
    and ``watch`` told: the BEGIN sqlite3 sends by itself before a write, a SAVEPOINT that
    would begin a transaction, a write it does not take for one (``WITH ... INSERT``) that
    would commit alone in autocommit."""

    def authorize(action: int, *args: Any) -> int:
        if action == sqlite3.SQLITE_TRANSACTION and str(args[0]).upper() == "COMMIT":
            watch.refuse_raw_end("commit")
            return sqlite3.SQLITE_DENY
        if not raw.in_transaction:
            watch.ended_below("a statement after the transaction ended, refused")
            return sqlite3.SQLITE_DENY
        if action == sqlite3.SQLITE_TRANSACTION:
            watch.ended_below(f"a {str(args[0]).upper()} on the raw connection")
        return sqlite3.SQLITE_OK

    raw.set_authorizer(authorize)
    return lambda: raw.set_authorizer(None)


_MYSQL_METHODS = ("query", "begin", "autocommit", "select_db", "set_character_set")


def _refuse_mysql(raw: Any, refuse: Refuse) -> None:
    """PyMySQL and aiomysql: every statement a cursor of theirs sends (``execute``,
    ``executemany``, ``callproc``) goes out through the connection's ``query()``; its text
    is read (db.control_sql, as MySQL's lexer reads it) and transaction control, or a
    statement that commits implicitly, refused for the call. ``begin()`` (a BEGIN: the
    transaction so far commits) and ``autocommit(True)`` (SET AUTOCOMMIT = 1: the same)
    are refused too, and ``select_db()`` and ``set_character_set()`` (what later messages
    on the pooled connection would inherit). Replaced on the instance, as ``commit`` is
    (unlock removes them)."""
    kind = type(raw)
    coroutine = inspect.iscoroutinefunction(kind.query)

    def control(sql: Any) -> str | None:
        text = sql.decode("utf-8", "surrogateescape") if isinstance(sql, bytes) else str(sql)
        return transaction_control(text, "mysql")

    if coroutine:

        async def query_async(sql: Any, *args: Any, **kwargs: Any) -> Any:
            if control(sql):
                raise refuse("query")
            return await kind.query(raw, sql, *args, **kwargs)

        async def autocommit_async(value: Any) -> Any:
            if value:
                raise refuse("autocommit")
            return await kind.autocommit(raw, value)

        raw.query, raw.autocommit = query_async, autocommit_async
    else:

        def query_now(sql: Any, *args: Any, **kwargs: Any) -> Any:
            if control(sql):
                raise refuse("query")
            return kind.query(raw, sql, *args, **kwargs)

        def autocommit_now(value: Any) -> Any:
            if value:
                raise refuse("autocommit")
            return kind.autocommit(raw, value)

        raw.query, raw.autocommit = query_now, autocommit_now
    raw.begin = _refusal(refuse, "begin", coroutine)
    # The session's database and character set, for the messages after this one too.
    for word in ("select_db", "set_character_set"):  # aiomysql has no set_character_set
        if hasattr(kind, word):
            coroutine_method = inspect.iscoroutinefunction(getattr(kind, word))
            setattr(raw, word, _refusal(refuse, word, coroutine_method))


def _refuse_sql(raw: Any, watch: StatementWatch) -> Callable[[], None]:
    """aiosqlite's own way to send SQL (its thread's sqlite3 connection): COMMIT denied for
    the call; PyMySQL's and aiomysql's (``_refuse_mysql``). (psycopg's cursors are watched
    by ``_watch_psycopg``.)"""
    if type(raw).__module__.split(".")[0] in ("pymysql", "aiomysql"):
        _refuse_mysql(raw, watch.refuse_raw_end)
        return lambda: None
    inner = getattr(raw, "_conn", None)
    if isinstance(inner, sqlite3.Connection):
        try:
            return _deny_on_sqlite(inner, watch)
        except sqlite3.ProgrammingError as exc:  # made with check_same_thread=True
            raise ConfigurationError(
                f"aiosqlite: a COMMIT sent through the raw connection cannot be refused while "
                f"a handler runs ({exc}); leave check_same_thread to aiosqlite"
            ) from exc
    return lambda: None  # neither psycopg nor aiosqlite: commit() was all it had


def _guarded_cursor(base: type) -> type:
    """``base`` (a psycopg cursor class) whose statements are watched while a handler runs."""
    if base in _guarded or getattr(base, "_consumerdedup_guarded", False):
        return _guarded.get(base, base)
    coroutine = inspect.iscoroutinefunction(getattr(base, "execute", None))

    def method(name: str) -> Callable[..., Any]:
        parent = getattr(base, name)
        many = name == "executemany"
        lazy = name in _LAZY

        def checked(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
            if _expired and self in _expired:
                raise TransactionBroken(_EXPIRED)
            watch: StatementWatch | None = vars(self.connection).get(_WATCH)
            if watch is None:
                return parent(self, query, *args, **kwargs)
            first = watch.before_sql(_text(self, query), args[0] if args else None, many)
            if first is not None:
                watch.sent_first(first, send_first(self, first))
            if lazy:
                return parent(self, query, *args, **kwargs)
            try:
                result = parent(self, query, *args, **kwargs)
            except Exception as error:
                watch.failed_sql(error)
                raise
            watch.after_sql()
            return result

        async def checked_async(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
            if _expired and self in _expired:
                raise TransactionBroken(_EXPIRED)
            watch: StatementWatch | None = vars(self.connection).get(_WATCH)
            if watch is None:
                return await parent(self, query, *args, **kwargs)
            first = watch.before_sql(_text(self, query), args[0] if args else None, many)
            if first is not None:
                watch.sent_first(first, await send_first_async(self, first))
            try:
                result = await parent(self, query, *args, **kwargs)
            except Exception as error:
                watch.failed_sql(error)
                raise
            watch.after_sql()
            return result

        return checked_async if coroutine and inspect.iscoroutinefunction(parent) else checked

    namespace: dict[str, Any] = {
        name: method(name) for name in _CURSOR_METHODS if hasattr(base, name)
    }
    namespace["_consumerdedup_guarded"] = True
    namespace["__slots__"] = ()  # the layout of ``base``: an instance's class can be swapped
    _guarded[base] = guarded = type(base.__name__, (base,), namespace)
    return guarded


def _text(cursor: Any, query: Any) -> str:
    """The SQL text of what a psycopg cursor was given."""
    if isinstance(query, str):
        return query
    if isinstance(query, bytes | bytearray | memoryview):
        # As the server will read them: in the connection's client encoding (SJIS and
        # others have multibyte characters whose second byte is a backslash or a quote).
        return bytes(query).decode(cursor.connection.info.encoding, "replace")
    if callable(getattr(query, "as_string", None)):  # psycopg.sql.Composable
        return str(query.as_string(cursor))
    return str(query)


def _refusal(refuse: Refuse, word: str, coroutine: bool) -> Callable[..., Any]:
    if coroutine:

        async def refuse_async(*_args: Any, **_kwargs: Any) -> None:
            raise refuse(word)

        return refuse_async

    def refuse_now(*_args: Any, **_kwargs: Any) -> None:
        raise refuse(word)

    return refuse_now
