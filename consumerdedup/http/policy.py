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

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, TypeVar

from ..errors import ConfigurationError
from .fingerprint import Fingerprinter, RequestFacts, default_fingerprint

DEDUPLICABLE = frozenset({"POST", "PATCH"})
"""The only methods a policy may name; every other one is idempotent by contract."""
MARK = "__consumerdedup_idempotency__"
"""The attribute ``@idempotent`` sets on an endpoint (read by IdempotencyPolicy.with_routes)."""

F = TypeVar("F", bound=Callable[..., Any])


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
    """How long an in-flight claim holds without renewal (the middleware renews it while the
    endpoint runs); a worker that dies frees its keys after this long."""
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

    def __post_init__(self) -> None:
        methods = frozenset(m.upper() for m in self.methods)
        if not methods or not methods <= DEDUPLICABLE:
            raise ConfigurationError(
                f"idempotency methods {sorted(self.methods)!r}: choose among POST and PATCH "
                "(GET, HEAD, PUT, DELETE and OPTIONS are idempotent by contract and pass through)"
            )
        object.__setattr__(self, "methods", methods)
        for name in ("required", "transactional"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigurationError(f"idempotency {name} must be a bool")
        for name in ("wait", "expiry", "lease"):
            value = getattr(self, name)
            if not isinstance(value, timedelta) or value < timedelta(0):
                raise ConfigurationError(f"idempotency {name} must be a timedelta >= 0")
        if self.expiry <= timedelta(0) or self.lease <= timedelta(0):
            raise ConfigurationError("idempotency expiry and lease must be longer than zero")
        for name in ("max_stored_body", "max_request_body"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigurationError(f"idempotency {name} must be an int >= 0 (bytes)")
        if not callable(self.fingerprint):
            raise ConfigurationError("idempotency fingerprint must be a callable")

    def applies_to(self, method: str) -> bool:
        return method.upper() in self.methods


class RoutePattern:
    """``/orders/{id}/pay`` (one segment per ``{name}`` or ``{name:conv}``), a trailing ``*``."""

    def __init__(self, pattern: str) -> None:
        if not isinstance(pattern, str) or not pattern.startswith("/"):
            raise ConfigurationError(f"route pattern {pattern!r} must be a path starting with /")
        self.pattern = pattern
        body = pattern[:-1] if pattern.endswith("*") else pattern
        regex = ""
        for part in re.split(r"(\{[^{}]*\})", body):
            if part.startswith("{"):
                regex += "[^/]+"
            elif "{" in part or "}" in part:
                raise ConfigurationError(f"route pattern {pattern!r} has an unbalanced brace")
            else:
                regex += re.escape(part)
        self._regex = re.compile(regex + (".*" if pattern.endswith("*") else ""))

    def matches(self, path: str) -> bool:
        return self._regex.fullmatch(path) is not None

    def __repr__(self) -> str:
        return f"RoutePattern({self.pattern!r})"


@dataclass(frozen=True)
class IdempotencyPolicy:
    """The default policy, and the routes that override it (first matching pattern wins)."""

    default: RoutePolicy = field(default_factory=RoutePolicy)
    routes: tuple[tuple[RoutePattern, RoutePolicy], ...] = ()

    @classmethod
    def of(
        cls, routes: Mapping[str, RoutePolicy] | None = None, default: RoutePolicy | None = None
    ) -> IdempotencyPolicy:
        """``IdempotencyPolicy.of({"/payments": RoutePolicy(required=True)})``."""
        pairs = tuple((RoutePattern(p), _checked(p, rp)) for p, rp in (routes or {}).items())
        return cls(default or RoutePolicy(), pairs)

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
                marked.append((RoutePattern(path), mark))
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
                "a transactional idempotency route needs the middleware's engine "
                f"({middleware}(app, engine)): its records live in that database"
            )
        return resolved

    def for_request(self, method: str, path: str) -> RoutePolicy | None:
        """The policy for this request, or None when it passes through untouched."""
        chosen = next((rp for pat, rp in self.routes if pat.matches(path)), self.default)
        return chosen if chosen.applies_to(method) else None


def _checked(pattern: str, policy: object) -> RoutePolicy:
    if not isinstance(policy, RoutePolicy):
        raise ConfigurationError(f"route {pattern!r}: expected a RoutePolicy, not {policy!r}")
    return policy


def idempotent(policy: RoutePolicy | None = None, **settings: Any) -> Callable[[F], F]:
    """Mark an endpoint: ``@idempotent(required=True, transactional=True)``.

    Takes a RoutePolicy or its fields; the middleware applies it to the
    endpoint's route when given the app's routes (``routes=app.routes``).
    """
    chosen = replace(policy, **settings) if policy is not None else RoutePolicy(**settings)

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
    "IdempotencyPolicy",
    "RequestFacts",
    "RoutePattern",
    "RoutePolicy",
    "idempotent",
    "route_mark",
]
