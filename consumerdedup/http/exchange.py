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
from collections.abc import Callable, Iterable
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from ..errors import ConfigurationError
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
    for name in _STORE_METHODS:
        method = getattr(store, name, None)
        if not blocking and not callable(method):
            raise ConfigurationError(f"{middleware}: the store has no {name}()")
        if blocking and (not callable(method) or inspect.iscoroutinefunction(method)):
            raise ConfigurationError(
                f"{middleware}: the store's {name}() must be a blocking "
                "method (an IdempotencyStore such as SqlStore or RedisStore, not an async one)"
            )


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
        self._routes = routes
        self._has_engine = has_engine
        self._middleware = middleware
        self._policy: IdempotencyPolicy | None = None
        self._lock = threading.Lock()

    def get(self) -> IdempotencyPolicy:
        with self._lock:
            if self._policy is None:
                self._policy = self._base.for_middleware(
                    self._routes, has_engine=self._has_engine, middleware=self._middleware
                )
            return self._policy


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
