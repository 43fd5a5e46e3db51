"""``WSGIIdempotencyMiddleware(app, engine)``: the idempotency-key algorithm for WSGI apps.

The twin of the ASGI middleware (asgi.py) for Flask, Django and any WSGI app: it drives
the same flow.decide, so the two cannot disagree on a rule; only the I/O differs. It reads
the request body whole (to fingerprint it, then hands the app a fresh ``wsgi.input``),
claims the key, runs the app with its whole response held back (while a thread renews the
lease), stores the response, and only then returns it to the server. A response longer
than the route's max_stored_body is recorded as not stored before its first byte leaves,
then streamed: a retry gets a 409 problem, never a second run. In transactional mode the
app finds the request's Session at ``environ["consumerdedup.session"]``; its writes commit
with the stored response before the response is returned. One request's work is
wsgi_exchange.Exchange.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ..errors import ConfigurationError
from ..options import refuse
from ..schema import DEFAULT, Tables
from . import flow
from .exchange import (
    SESSION_KEY,  # the same key in the WSGI environ as in the ASGI scope
    ResolvedPolicy,
    check_options,
    check_store,
)
from .policy import IdempotencyPolicy
from .sql_store import SqlStore
from .wsgi_exchange import Environ, Exchange, StartResponse, WSGIApp

Principal = Callable[[Mapping[str, Any]], "str | int | None"]

_HEADERS_WITHOUT_PREFIX = {"CONTENT_TYPE": "content-type", "CONTENT_LENGTH": "content-length"}


class WSGIIdempotencyMiddleware:
    """Idempotency keys for a WSGI app; ``engine`` (a blocking Engine) holds the records.

    The same options as the ASGI IdempotencyMiddleware: ``store`` (a blocking
    IdempotencyStore, e.g. RedisStore, for non-transactional routes), ``policy``,
    ``routes`` (objects with ``.path`` and ``.endpoint`` whose ``@idempotent`` marks join
    the policy), ``principal(environ)`` (who is calling: part of every key's scope),
    ``session_factory`` (the transactional Session; default ``Session(engine)``).
    """

    def __init__(
        self,
        app: WSGIApp,
        engine: Engine | None = None,
        *,
        store: Any = None,
        policy: IdempotencyPolicy | None = None,
        routes: Iterable[object] = (),
        principal: Principal | None = None,
        tables: Tables = DEFAULT,
        session_factory: Callable[[], Session] | None = None,
    ) -> None:
        check_options(
            "WSGIIdempotencyMiddleware", app, policy, routes, principal, tables, session_factory
        )
        if engine is not None and not isinstance(engine, Engine):
            raise refuse(
                "WSGIIdempotencyMiddleware.engine",
                engine,
                "a blocking SQLAlchemy Engine (a WSGI app runs in threads; give an AsyncEngine "
                "to the ASGI middleware)",
            )
        self.app = app
        self.engine = engine
        self.sql_store = SqlStore(engine, tables) if engine is not None else None
        if store is None and self.sql_store is None:
            raise ConfigurationError(
                "WSGIIdempotencyMiddleware needs an engine or a store (engine=, store=): the "
                "records need a place"
            )
        self.store: Any = store if store is not None else self.sql_store
        check_store(self.store, "WSGIIdempotencyMiddleware", blocking=True)
        self._policy = ResolvedPolicy(
            policy,
            routes,
            has_engine=self.sql_store is not None,
            middleware="WSGIIdempotencyMiddleware",
        )
        self.principal = principal
        self.session_factory = session_factory

    @property
    def policy(self) -> IdempotencyPolicy:
        """The policy with the routes' marks; resolved once, at the first request."""
        return self._policy.get()

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        principal = self.principal(environ) if self.principal is not None else None
        incoming = flow.Incoming(
            environ["REQUEST_METHOD"],
            _path(environ),
            environ.get("QUERY_STRING", "").encode("latin-1"),
            _headers(environ),
            principal,
        )
        return Exchange(self, environ, start_response).drive(flow.decide(incoming, self.policy))


def _path(environ: Environ) -> str:
    """The full path as ASGI spells it: WSGI gives latin-1 str of the raw bytes."""
    path = str(environ.get("SCRIPT_NAME", "")) + str(environ.get("PATH_INFO", ""))
    return path.encode("latin-1").decode("utf-8", "surrogateescape")


def _headers(environ: Environ) -> tuple[tuple[str, str], ...]:
    pairs = []
    for name, value in environ.items():
        if name.startswith("HTTP_"):
            pairs.append((name[5:].replace("_", "-").lower(), str(value)))
        elif name in _HEADERS_WITHOUT_PREFIX and value:
            pairs.append((_HEADERS_WITHOUT_PREFIX[name], str(value)))
    return tuple(pairs)


__all__ = ["SESSION_KEY", "WSGIIdempotencyMiddleware"]
