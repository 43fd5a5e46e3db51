"""The SQLAlchemy listeners of the handler guard, and how they find the call they serve.

A session handed to a handler listens for ``before_commit`` and ``after_begin``; on
SQLite the connection the session really uses in the pipeline's transaction listens for
``before_cursor_execute``, ``after_cursor_execute`` and ``commit`` (on psycopg the
driver's cursors are watched instead: raw_commit). They act only
while a HandlerCall runs on that very object: it sets itself in the object's
``info`` under ``CALL`` and takes itself out when the call ends.

Where they are installed. Nothing goes on the application's engine, its dialect or
pool, nor on SQLAlchemy's Session class. A deduplicator's own session factory (the
default, no ``session_factory=``) makes its sessions on a copy of the engine
(``execution_options()``: the same pool and dialect, its own listeners) and of its
own session class, both carrying the listeners from the start: every transaction
brings a new Session and Connection, and listening on each cost about 75 us a
message (measured), more than anything else the guard does. Sessions from an
application's ``session_factory`` get the listeners on the instance, the first time
one is handed to a handler, and so does the connection each transaction uses.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, Engine, event
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session, sessionmaker

from ..db import pipelined_begin
from ..errors import TransactionBroken

CALL = "consumerdedup.handler_call"
"""In ``session.info`` and the connection's ``info``: the HandlerCall running on it."""
_watched: weakref.WeakSet[Any] = weakref.WeakSet()
"""Our engine copies and the sessions and connections that carry our listeners."""
_installing = threading.Lock()
"""Two threads seeing an engine first must not both listen: each event would run twice."""


def _route_session(method: str) -> Callable[..., None]:
    """A session listener that hands the event to the call running on that session."""

    def listener(target: Any, *args: Any) -> None:
        call = target.info.get(CALL)
        if call is not None:
            getattr(call, method)(target, *args)

    return listener


def _route_connection(method: str) -> Callable[..., None]:
    """A connection listener that hands the event to the call running on this very
    connection: another Connection of our engine copy on the same pooled DB-API connection
    (one a handler gave back, checked out elsewhere) is not the call's."""

    def listener(target: Connection, *args: Any) -> None:
        call = target.info.get(CALL)
        if call is not None and call.connection is target:
            getattr(call, method)(target, *args)

    return listener


_SPENT = "consumerdedup.spent"
"""In a PipelineSession's ``info``: its attempt is over."""


def _refuse_spent(session: Session, _transaction: Any, connection: Connection) -> None:
    if session.info.get(_SPENT):
        connection.close()  # back to the pool at once, rolled back, not left to the GC
        raise TransactionBroken(
            "a session handed to a handler was used after the pipeline was done with it (a "
            "thread or task the handler left running?): its writes would commit apart from "
            "any record; do all of a message's work inside its handler call"
        )


def spend(session: Session) -> None:
    """The attempt on ``session`` is over: if it is one of ours, it begins nothing more."""
    if isinstance(session, PipelineSession):
        session.info[_SPENT] = True


SESSION_EVENTS = [
    ("before_commit", _route_session("refuse_commit")),
    ("after_begin", _route_session("refuse_second_connection")),
]
CONNECTION_EVENTS = [
    ("before_cursor_execute", _route_connection("before_statement")),
    ("after_cursor_execute", _route_connection("after_statement")),
    ("commit", _route_connection("on_commit")),
]


def _listen_once(target: Any, events: list[tuple[str, Any]]) -> None:
    if target in _watched:
        return
    with _installing:
        if target not in _watched:
            for name, fn in events:
                event.listen(target, name, fn)
            _watched.add(target)


class PipelineSession(Session):
    """The session class of a deduplicator's own factory: it carries the listeners. Once
    its attempt is over (``spend``), it begins no transaction: a session a handler kept (a
    thread, a task) would commit its writes apart from any record."""


def statements_on_driver(engine: Engine) -> bool:
    """On psycopg the handler's statements are watched at the driver's cursors
    (raw_commit), not through SQLAlchemy's cursor events: about 20 us a statement less."""
    return engine.dialect.driver == "psycopg"


def _listen_on_copy(copy: Engine) -> None:
    if statements_on_driver(copy):
        _watched.add(copy)  # nothing to listen for: a HandlerCall watches the cursors
    else:
        _listen_once(copy, CONNECTION_EVENTS)


def guarded_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """A deduplicator's own session factory: PipelineSessions on a copy of ``engine``
    (the same pool and dialect) whose connections carry the listeners; ``engine`` itself
    gets none."""
    copy = engine.execution_options()
    _listen_on_copy(copy)
    pipelined_begin.mark_ours(copy)
    return sessionmaker(copy, class_=PipelineSession, expire_on_commit=False)


def guarded_async_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    """``guarded_sessionmaker`` for an AsyncEngine."""
    copy = engine.execution_options()
    _listen_on_copy(copy.sync_engine)
    pipelined_begin.mark_ours(copy.sync_engine)
    return async_sessionmaker(copy, sync_session_class=PipelineSession, expire_on_commit=False)


_listen_once(PipelineSession, SESSION_EVENTS)
event.listen(PipelineSession, "after_begin", _refuse_spent)


def watch_session(session: Session) -> None:
    """``session`` listens (at once if it is a PipelineSession)."""
    if not isinstance(session, PipelineSession):
        _listen_once(session, SESSION_EVENTS)


def watch_connection(connection: Connection) -> None:
    """``connection`` listens (at once if it comes from a guarded_engine)."""
    if connection.engine not in _watched:
        _listen_once(connection, CONNECTION_EVENTS)
