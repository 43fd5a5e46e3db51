"""What the ASGI and the WSGI middleware share around flow.decide, without I/O.

Both drivers check their store the same way, resolve the policy once, and read a
failed claim alike: a setup fault stays loud, SQLite's busy write lock is StoreBusy,
a lock timeout elsewhere is a twin in flight, anything else is StoreFailed. Only
the carrying out (awaited or blocking) stays in asgi_exchange.py and wsgi.py.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from ..errors import ConfigurationError
from ..options import function, instance, maybe, refuse
from ..schema import Tables
from . import flow
from .policy import IdempotencyPolicy
from .sql_statements import is_lock_timeout
from .store import InFlight
from .stored import StoredResponse

SESSION_KEY = "consumerdedup.session"
"""Where a transactional endpoint finds the request's Session (ASGI scope, WSGI environ)."""
log = logging.getLogger("consumerdedup.http")
_STORE_METHODS = ("claim", "renew", "complete", "release")


def check_store(store: Any, middleware: str, *, blocking: bool) -> None:
    """Refuse a store without the four methods (``blocking``: or with an async one)."""
    option = f"{middleware}.store"
    for name in _STORE_METHODS:
        method = getattr(store, name, None)
        if not blocking and not callable(method):
            raise refuse(option, store, f"an idempotency store (one with {name}())")
        if blocking and (not callable(method) or inspect.iscoroutinefunction(method)):
            raise refuse(
                option,
                store,
                f"a blocking idempotency store (its {name}() a blocking method: SqlStore or "
                "RedisStore, not an async one)",
            )


def check_options(
    middleware: str,
    app: object,
    policy: object,
    routes: object,
    principal: object,
    tables: object,
    session_factory: object,
) -> None:
    """What both middleware take besides the engine and the store, checked as given."""
    at = middleware + "."
    function(app, at + "app", "the app to wrap (a callable)")
    maybe(policy, at + "policy", instance, IdempotencyPolicy,
          "an IdempotencyPolicy (IdempotencyPolicy.of({...}))")  # fmt: skip
    # Kept as given, not copied: app.routes may still grow before the first request.
    if isinstance(routes, str | bytes | Mapping) or not isinstance(routes, Iterable):
        raise refuse(at + "routes", routes, "the app's routes (a list such as app.routes)")
    maybe(principal, at + "principal", function,
          "a callable(scope or environ) -> str | int | None", blocking=True)  # fmt: skip
    instance(tables, at + "tables", Tables, "a Tables (Tables.define(...))")
    maybe(session_factory, at + "session_factory", function, "a callable() -> Session",
          blocking=True)  # fmt: skip


class ResolvedPolicy:
    """The policy with the routes' ``@idempotent`` marks, resolved once, at the first request."""

    def __init__(
        self,
        base: IdempotencyPolicy | None,
        routes: Iterable[object],
        *,
        has_engine: bool,
        middleware: str,
    ) -> None:
        self._base = base if base is not None else IdempotencyPolicy()
        # A one-shot iterator is read once; a list (app.routes) is kept, as it may still grow.
        self._routes = list(routes) if isinstance(routes, Iterator) else routes
        self._has_engine = has_engine
        self._middleware = middleware
        self._policy: IdempotencyPolicy | None = None
        self._lock = threading.Lock()
        # Checked now with the routes the app has so far (a transactional route on a store
        # without an engine, a mark whose path can never match), again at the first request.
        self._base.for_middleware(list(self._routes), has_engine=has_engine, middleware=middleware)

    def get(self) -> IdempotencyPolicy:
        with self._lock:
            if self._policy is None:
                self._policy = self._base.for_middleware(
                    self._routes, has_engine=self._has_engine, middleware=self._middleware
                )
            return self._policy


class LeaseWatch:
    """Whether a claim's lease ran out while its endpoint ran, by this process's clock.

    The lease runs out ``lease`` after the claim (or the last renewal that held) was sent;
    a renewal that comes back after that, or finds the claim lost, means it ran out. A
    little early, never late: the store starts its lease when the statement arrives."""

    def __init__(self, lease: timedelta, claim_sent: float) -> None:
        self.seconds = lease.total_seconds()
        self.deadline = claim_sent + self.seconds
        self.ran_out = False

    @staticmethod
    def now() -> float:
        return time.monotonic()

    def renewed(self, sent: float, kept: bool) -> None:
        if not kept or self.now() > self.deadline:
            self.ran_out = True
        if kept:
            self.deadline = max(self.deadline, sent + self.seconds)

    def lapsed(self) -> bool:
        return self.ran_out or self.now() > self.deadline


def new_session(factory: Callable[[], Any] | None, engine: Engine | AsyncEngine | None) -> Any:
    """The transactional request's Session: ``factory()``, else one on the engine."""
    if factory is not None:
        return factory()
    if isinstance(engine, AsyncEngine):
        return AsyncSession(engine, expire_on_commit=False)
    return Session(engine, expire_on_commit=False)


def claim_failed(error: Exception, scope: str) -> flow.StoreFailed:
    """A store's claim raised: refuse (StoreFailed); a setup fault stays loud (500)."""
    if isinstance(error, ConfigurationError):
        raise error  # never passed off as an outage
    log.exception("idempotency store failed to claim for %s", scope, exc_info=error)
    return flow.StoreFailed()


def claim_in_failed(
    error: Exception, dialect: str, scope: str
) -> flow.StoreFailed | flow.StoreBusy | InFlight:
    """A transactional claim_in raised (its session is closed): what to send flow."""
    if isinstance(error, ConfigurationError) or not is_lock_timeout(error):
        return claim_failed(error, scope)
    if dialect == "sqlite":
        # SQLite serialises writers: BEGIN IMMEDIATE timed out on the database's
        # write lock, held by a twin or by any other transactional request.
        log.info("idempotency store busy for %s: SQLite's write lock", scope)
        return flow.StoreBusy()
    return InFlight(1.0)


COMMITTED_BEHIND = StoredResponse.unreplayable(500, "the endpoint committed its claim itself")
"""What a transactional request that did not complete leaves when the endpoint had committed
its claim itself (the DB-API connection's own commit(), which no event of ours sees): the
claim row, and whatever the endpoint wrote, were committed with no response. Left in flight,
its lease would run out and the retry would run the endpoint again; recorded as ran but not
stored (the claim's token, so never a twin's record), a retry is refused (409
response-not-stored). Written after the request's rollback; it finds no row otherwise."""


def log_committed_behind(scope: str) -> None:
    log.error(
        "idempotency claim committed by the endpoint %s: recorded as not stored, a retry "
        "is refused; leave the commit to the middleware",
        scope,
    )


def log_rolled_back(scope: str) -> None:
    """A transactional Complete found its claim gone: the endpoint rolled back."""
    log.error(
        "idempotency claim lost %s: the endpoint rolled back the request's "
        "transaction; nothing stored or committed",
        scope,
    )
