"""FastAPI: mark a route idempotent, declare its Idempotency-Key header, get its Session.

``dependencies=[Idempotent(required=True)]`` marks a route (the middleware,
given ``routes=app.routes``, applies the policy) and puts the header in the
OpenAPI schema, so the API's documentation says which endpoints are
idempotent and whether the key is required. ``session = TransactionalSession()``
does the same for a transactional route and hands the endpoint the request's
Session (or AsyncSession), which the middleware commits with the stored
response. Needs the ``fastapi`` extra.

The dependencies are ``async def``: FastAPI runs a plain ``def`` dependency in a worker
thread, which made every transactional request two thread hops for two lookups (seen in
the profile of bench_http: anyio's run_sync twice per request).
"""

# No `from __future__ import annotations`: FastAPI reads these signatures, whose
# annotations name local dependencies.
from typing import Annotated, Any

try:
    from fastapi import Depends, Header, Request
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "consumerdedup.http.fastapi needs FastAPI: pip install 'consumerdedup[fastapi]'"
    ) from error

from ..errors import ConfigurationError
from .asgi import SESSION_KEY
from .policy import MARK, RoutePolicy, route_policy

_DESCRIPTION = (
    "Makes this request safe to retry: send a new unique key (e.g. a UUID, 1-255 printable ASCII "
    'characters, bare or as a quoted string "...") for each new operation and the same key when '
    "retrying it. A completed response is replayed with Idempotent-Replayed: true; 409 means the "
    "first request is still running (retry after Retry-After); 422 means the key was used for a "
    "different request."
)


def _header_dependency(route: RoutePolicy) -> Any:
    description = ("Required. " if route.required else "Optional. ") + _DESCRIPTION
    if route.required:

        async def required_key(
            key: Annotated[str, Header(alias="Idempotency-Key", description=description)],
        ) -> str:
            return key

        return required_key

    async def optional_key(
        key: Annotated[str | None, Header(alias="Idempotency-Key", description=description)] = None,
    ) -> str | None:
        return key

    return optional_key


def Idempotent(policy: RoutePolicy | None = None, **settings: Any) -> Any:
    """A dependency marking its route with a RoutePolicy (or its fields) and the header."""
    route = route_policy(policy, settings, "Idempotent")
    header = _header_dependency(route)

    async def idempotency_key(key: Annotated[str | None, Depends(header)]) -> str | None:
        return key

    setattr(idempotency_key, MARK, route)
    return Depends(idempotency_key)


def TransactionalSession(policy: RoutePolicy | None = None, **settings: Any) -> Any:
    """A dependency giving a transactional route the request's Session (marks the route too)."""
    route = route_policy(policy, {"transactional": True, **settings}, "TransactionalSession")
    if not route.transactional:
        raise ConfigurationError(
            "TransactionalSession(transactional=False): TransactionalSession is for "
            "transactional routes (use Idempotent(...) for the others)"
        )
    header = _header_dependency(route)

    async def idempotency_session(request: Request, key: Annotated[Any, Depends(header)]) -> Any:
        session = request.scope.get(SESSION_KEY)
        if session is None:
            # Fail closed: without the middleware's session the writes would commit unguarded.
            raise ConfigurationError(
                f"{request.method} {request.url.path}: no idempotency session; install "
                "IdempotencyMiddleware(app, engine, routes=app.routes) and send an Idempotency-Key"
            )
        return session

    setattr(idempotency_session, MARK, route)
    return Depends(idempotency_session)
