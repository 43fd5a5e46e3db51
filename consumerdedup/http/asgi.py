"""``IdempotencyMiddleware(app, engine)``: the idempotency-key algorithm as pure ASGI.

No framework needed (Starlette, FastAPI and a bare ASGI callable all work).
It drives flow.decide: reads the request body whole (to fingerprint it and
hand it to the app again), claims the key, runs the app with its response
held back, stores the response, and only then sends it. A response longer
than the route's max_stored_body (or streamed past it) is recorded as not
stored before its first byte leaves, then streamed: a retry gets a 409
problem, never a second run. In transactional mode the app finds the
request's Session (or AsyncSession) at ``scope["consumerdedup.session"]``
(see consumerdedup.http.fastapi for a dependency), and its writes commit
with the stored response before the response is sent. One request's work
(the operations carried out) is asgi_exchange.Exchange.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from ..errors import ConfigurationError
from ..options import refuse
from ..schema import DEFAULT, Tables
from . import flow
from .asgi_exchange import ASGIApp, Exchange, Receive, Scope, Send
from .exchange import SESSION_KEY, ResolvedPolicy, check_options, check_store
from .policy import IdempotencyPolicy
from .sql_store import AsyncSqlStore, SqlStore

Principal = Callable[[Mapping[str, Any]], "str | int | None"]


class IdempotencyMiddleware:
    """Idempotency keys for an ASGI app; ``engine`` (Engine or AsyncEngine) holds the records.

    ``store``: another IdempotencyStore (e.g. Redis) for non-transactional routes;
    ``policy``: the routes and defaults (IdempotencyPolicy); ``routes``: the
    app's routes (``app.routes``), whose ``@idempotent`` marks join the policy
    at the first request; ``principal(scope)``: who is calling (user, API key,
    tenant), part of every key's scope; ``session_factory``: makes the
    transactional Session (default: ``Session(engine)`` / ``AsyncSession(engine)``).
    """

    def __init__(
        self,
        app: ASGIApp,
        engine: Engine | AsyncEngine | None = None,
        *,
        store: Any = None,
        policy: IdempotencyPolicy | None = None,
        routes: Iterable[object] = (),
        principal: Principal | None = None,
        tables: Tables = DEFAULT,
        session_factory: Callable[[], Session | AsyncSession] | None = None,
    ) -> None:
        check_options(
            "IdempotencyMiddleware", app, policy, routes, principal, tables, session_factory
        )
        self.app = app
        self.engine = engine
        self.sql_store: SqlStore | AsyncSqlStore | None = None
        if isinstance(engine, AsyncEngine):
            self.sql_store = AsyncSqlStore(engine, tables)
        elif isinstance(engine, Engine):
            self.sql_store = SqlStore(engine, tables)
        elif engine is not None:
            raise refuse(
                "IdempotencyMiddleware.engine", engine, "a SQLAlchemy Engine or AsyncEngine"
            )
        if store is None and self.sql_store is None:
            raise ConfigurationError(
                "IdempotencyMiddleware needs an engine or a store (engine=, store=): the "
                "records need a place"
            )
        self.store: Any = store if store is not None else self.sql_store
        check_store(self.store, "IdempotencyMiddleware", blocking=False)
        self._policy = ResolvedPolicy(
            policy,
            routes,
            has_engine=self.sql_store is not None,
            middleware="IdempotencyMiddleware",
        )
        self.principal = principal
        self.session_factory = session_factory
        # Over an AsyncEngine a twin may wait on the row lock (no thread is held meanwhile);
        # over a blocking one it would hold one of asyncio's few worker threads, which the
        # first request needs to commit: the twin polls instead (flow.decide's lock_waits).
        self.lock_waits = isinstance(engine, AsyncEngine)

    @property
    def policy(self) -> IdempotencyPolicy:
        """The policy with the routes' marks; resolved once, at the first request."""
        return self._policy.get()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = tuple(
            (n.decode("latin-1").lower(), v.decode("latin-1")) for n, v in scope["headers"]
        )
        principal = self.principal(scope) if self.principal is not None else None
        incoming = flow.Incoming(
            scope["method"], scope["path"], scope.get("query_string", b""), headers, principal
        )
        steps = flow.decide(incoming, self.policy, lock_waits=self.lock_waits)
        await Exchange(self, scope, receive, send).drive(steps)


__all__ = ["SESSION_KEY", "IdempotencyMiddleware"]
