"""Which requests are deduplicated, and how: a policy per route, matched by path pattern.

``IdempotencyPolicy()`` alone is the default every middleware starts from:
POST only, the key optional (no key, no deduplication), responses kept 24 h.
Routes override it by pattern (``/payments``, ``/orders/{id}/pay``,
``/admin/*``; first match wins), or in code with ``@idempotent(...)`` on the
endpoint (the middleware reads the marks from the routes it is given).
GET, HEAD, PUT, DELETE and OPTIONS always pass through: they are idempotent
by contract, and a policy that names them is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from datetime import timedelta
from typing import Any, TypeVar

from ..errors import ConfigurationError
from ..options import (
    boolean,
    duration,
    function,
    instance,
    integer,
    integers,
    mapping,
    names,
    refuse,
    settle,
    text,
)
from .fingerprint import Fingerprinter, RequestFacts, default_fingerprint
from .patterns import RoutePattern

DEDUPLICABLE = frozenset({"POST", "PATCH"})
"""The only methods a policy may name; every other one is idempotent by contract."""
MARK = "__consumerdedup_idempotency__"
"""The attribute ``@idempotent`` sets on an endpoint (read by IdempotencyPolicy.with_routes)."""
LEASE_FLOOR = timedelta(seconds=1)
"""The shortest lease a policy takes. A lease is renewed every third of it while the
endpoint runs; one much shorter runs out before a renewal's round trip to the store (a
1 ms lease ran one endpoint three times for one key), and the promise is void."""

LONGEST = timedelta(days=3650)
"""The longest expiry or lease taken (ten years)."""

F = TypeVar("F", bound=Callable[..., Any])


def _method(value: object, option: str) -> str:
    method = text(value, option).upper()
    if method not in DEDUPLICABLE:
        raise refuse(
            option,
            value,
            "POST or PATCH (GET, HEAD, PUT, DELETE and OPTIONS are idempotent by contract "
            "and pass through)",
        )
    return method


@dataclass(frozen=True)
class RoutePolicy:
    """How one route's requests are deduplicated; validated at construction."""

    methods: frozenset[str] = frozenset({"POST"})
    required: bool = False
    """A request without a key is refused with 400 (else it runs without deduplication)."""
    wait: timedelta = timedelta(0)
    """How long a request waits for an in-flight twin to finish (then replays) before its 409."""
    expiry: timedelta = timedelta(hours=24)
    """How long a completed response is replayed; after that the key is a new request."""
    lease: timedelta = timedelta(seconds=60)
    """How long an in-flight claim holds without renewal (at least LEASE_FLOOR). The
    middleware renews it every third of it while the endpoint runs, so it bounds the longest
    stall of the renewal (a blocked event loop, an unreachable store), not the endpoint's
    run; a worker that dies frees its keys after this long."""
    retry_after: timedelta = timedelta(seconds=1)
    """What a 409 in-flight tells the client to wait (Retry-After, whole seconds): about the
    endpoint's typical run, never more than the rest of the twin's lease."""
    max_stored_body: int = 1024 * 1024
    """Longest response body stored; a longer (or streamed past it) response is sent once and
    recorded as not stored: a retry gets a problem response, never a second run."""
    max_request_body: int = 64 * 1024 * 1024
    """Longest request body read to fingerprint it; a longer one is refused with 413."""
    transactional: bool = False
    """SQL stores only: the endpoint gets the request's Session, whose business writes commit
    with the stored response in one transaction before the response is sent."""
    fingerprint: Fingerprinter = default_fingerprint
    """sha256 of what makes two requests "the same"; a key reused on another one gets 422."""
    unstored_statuses: frozenset[int] = frozenset()
    """4xx statuses not stored (e.g. 422 from request validation): the key is released, so a
    corrected request may reuse it; every retry of such a request runs the endpoint again."""

    def __post_init__(self) -> None:
        at = "RoutePolicy."
        settle(self, "methods", frozenset(names(self.methods, at + "methods", each=_method)))
        for flag in ("required", "transactional"):
            settle(self, flag, boolean(getattr(self, flag), at + flag))
        settle(self, "wait", duration(self.wait, at + "wait", zero=True))
        # Bounded so that now + it is a datetime (timedelta.max overflowed at every claim).
        settle(self, "expiry", duration(self.expiry, at + "expiry", at_most=LONGEST))
        lease = duration(self.lease, at + "lease", at_least=LEASE_FLOOR, at_most=LONGEST)
        settle(self, "lease", lease)
        second = timedelta(seconds=1)  # Retry-After is whole seconds
        settle(self, "retry_after", duration(self.retry_after, at + "retry_after", at_least=second))
        for size in ("max_stored_body", "max_request_body"):
            settle(self, size, integer(getattr(self, size), at + size, at_least=0))
        function(
            self.fingerprint, at + "fingerprint", "a callable(RequestFacts) -> str", blocking=True
        )
        statuses = integers(
            self.unstored_statuses, at + "unstored_statuses", at_least=400, at_most=499
        )
        settle(self, "unstored_statuses", statuses)

    def applies_to(self, method: str) -> bool:
        return method.upper() in self.methods


def route_policy(policy: object, settings: Mapping[str, Any], where: str) -> RoutePolicy:
    """``policy`` (or the default) with ``settings`` (RoutePolicy's fields) applied: what
    ``idempotent`` and the FastAPI dependencies take; an unknown setting names itself."""
    base = instance(
        RoutePolicy() if policy is None else policy, f"{where}.policy", RoutePolicy,
        "a RoutePolicy or None",
    )  # fmt: skip
    known = {f.name for f in fields(RoutePolicy)}
    for name in settings:
        if name not in known:
            raise ConfigurationError(
                f"{where}: {name}={settings[name]!r} is not a RoutePolicy option "
                f"(options: {', '.join(sorted(known))})"
            )
    return replace(base, **settings)


def _compiled(pattern: object, option: str) -> RoutePattern:
    if isinstance(pattern, RoutePattern):
        return pattern
    try:
        return RoutePattern(pattern)  # type: ignore[arg-type]
    except ConfigurationError as error:
        raise ConfigurationError(f"{option}: {error}") from None


def _pair(pattern: object, policy: object, where: str) -> tuple[RoutePattern, RoutePolicy]:
    chosen = _compiled(pattern, where)
    kept = instance(policy, f"{where}[{pattern!r}]", RoutePolicy, "a RoutePolicy")
    return chosen, kept


@dataclass(frozen=True)
class IdempotencyPolicy:
    """The default policy, and the routes that override it (first matching pattern wins)."""

    default: RoutePolicy = field(default_factory=RoutePolicy)
    routes: tuple[tuple[RoutePattern, RoutePolicy], ...] = ()
    """(pattern, policy) pairs, a pattern a RoutePattern or its str."""

    def __post_init__(self) -> None:
        instance(self.default, "IdempotencyPolicy.default", RoutePolicy, "a RoutePolicy")
        where = "IdempotencyPolicy.routes"
        if isinstance(self.routes, str | bytes | Mapping) or not isinstance(self.routes, Iterable):
            raise refuse(where, self.routes, "a tuple of (pattern, RoutePolicy) pairs")
        pairs = []
        for index, pair in enumerate(self.routes):
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise refuse(f"{where}[{index}]", pair, "a (pattern, RoutePolicy) pair")
            pairs.append(_pair(pair[0], pair[1], where))
        settle(self, "routes", tuple(pairs))

    @classmethod
    def of(
        cls, routes: Mapping[str, RoutePolicy] | None = None, default: RoutePolicy | None = None
    ) -> IdempotencyPolicy:
        """``IdempotencyPolicy.of({"/payments": RoutePolicy(required=True)})``."""
        where = "IdempotencyPolicy.of(routes)"
        given = mapping(routes, where, keys=_pattern) if routes is not None else {}
        pairs = tuple(_pair(pattern, policy, where) for pattern, policy in given.items())
        if default is None:  # only None: a falsy wrong value ({}) is refused, not replaced
            return cls(RoutePolicy(), pairs)
        chosen = instance(default, "IdempotencyPolicy.of(default)", RoutePolicy, "a RoutePolicy")
        return cls(chosen, pairs)

    def with_routes(self, routes: Iterable[object]) -> IdempotencyPolicy:
        """Add the routes whose endpoint carries ``@idempotent`` (or a marked dependency).

        Each route is anything with ``.path`` and ``.endpoint`` (Starlette's and
        FastAPI's routes are); its marks go before this policy's own patterns.
        """
        marked: list[tuple[RoutePattern, RoutePolicy]] = []
        for route in routes:
            mark = route_mark(route)
            path = getattr(route, "path", None)
            if mark is not None and isinstance(path, str):
                marked.append((_compiled(path, "routes (an @idempotent route's path)"), mark))
        return replace(self, routes=(*marked, *self.routes))

    def for_middleware(
        self, routes: Iterable[object], *, has_engine: bool, middleware: str
    ) -> IdempotencyPolicy:
        """This policy with ``routes``' marks, checked against what the middleware was given:
        a transactional route needs the middleware's engine (its records live there)."""
        resolved = self.with_routes(routes)
        chosen = [resolved.default, *(rp for _, rp in resolved.routes)]
        if not has_engine and any(rp.transactional for rp in chosen):
            raise ConfigurationError(
                f"{middleware}.policy: a transactional idempotency route needs the middleware's "
                f"engine ({middleware}(app, engine)): its records live in that database, and "
                "a Redis store cannot commit with the endpoint's writes"
            )
        return resolved

    def for_request(self, method: str, path: str) -> RoutePolicy | None:
        """The policy for this request, or None when it passes through untouched: the first
        route whose pattern matches the path and whose methods include the method. Two
        routes of one path (POST and PATCH ``/items``, each marked ``@idempotent``) each
        keep their own policy; taking the first by path alone let the PATCH endpoint run
        unprotected. A path some route matches, with none for this method, passes through;
        a path no route matches takes the default."""
        matched = False
        for pattern, route in self.routes:
            if pattern.matches(path):
                if route.applies_to(method):
                    return route
                matched = True
        if matched:
            return None
        return self.default if self.default.applies_to(method) else None


def _pattern(value: object, option: str) -> str:
    return _compiled(value, option).pattern


def idempotent(policy: RoutePolicy | None = None, **settings: Any) -> Callable[[F], F]:
    """Mark an endpoint: ``@idempotent(required=True, transactional=True)``.

    Takes a RoutePolicy or its fields; the middleware applies it to the
    endpoint's route when given the app's routes (``routes=app.routes``).
    """
    chosen = route_policy(policy, settings, "idempotent")

    def mark(endpoint: F) -> F:
        setattr(endpoint, MARK, chosen)
        return endpoint

    return mark


def route_mark(route: object) -> RoutePolicy | None:
    """The RoutePolicy marked on a route's endpoint, or on one of its FastAPI dependencies."""
    for candidate in (getattr(route, "endpoint", None), *_dependency_calls(route)):
        mark = getattr(candidate, MARK, None)
        if isinstance(mark, RoutePolicy):
            return mark
    return None


def _dependency_calls(route: object) -> list[object]:
    found: list[object] = []
    pending = list(getattr(getattr(route, "dependant", None), "dependencies", []))
    while pending:
        dependant = pending.pop()
        found.append(getattr(dependant, "call", None))
        pending.extend(getattr(dependant, "dependencies", []))
    return found


__all__ = [
    "DEDUPLICABLE",
    "LEASE_FLOOR",
    "IdempotencyPolicy",
    "RequestFacts",
    "RoutePattern",
    "RoutePolicy",
    "idempotent",
    "route_mark",
    "route_policy",
]
