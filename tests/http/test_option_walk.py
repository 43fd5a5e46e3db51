"""Invariant 10 for consumerdedup.http (issue 38 items 1 and 7): every option of every public
constructor refuses a wrong-typed value at construction with a ConfigurationError that
names it, never later at the first request.

WALK lists each constructor's options with wrong values (a string for a collection, a
callable or a bool, a float or a bool for an int, a number for a duration, a dict for a
policy); ``test_every_option_is_walked`` reads the signatures (and dataclass fields), so an
option added later without a line here fails the suite.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import redis
import redis.asyncio
from sqlalchemy import create_engine
from sqlalchemy.ext.asyncio import create_async_engine

from consumerdedup import ConfigurationError
from consumerdedup.http import (
    AsyncSqlStore,
    IdempotencyMiddleware,
    IdempotencyPolicy,
    RoutePolicy,
    SqlStore,
    WSGIIdempotencyMiddleware,
    idempotent,
    json_fields,
)
from consumerdedup.http.fastapi import Idempotent, TransactionalSession
from consumerdedup.http.redis_store import AsyncRedisStore, RedisStore

URL = "postgresql+psycopg://walk@127.0.0.1:5432/test"  # never connected to: construction only
ENGINE = create_engine(URL)
ASYNC_ENGINE = create_async_engine(URL)
REDIS = redis.Redis()  # redis-py connects lazily: construction only
ASYNC_REDIS = redis.asyncio.Redis()
TRANSACTIONAL = IdempotencyPolicy.of({"/pay": RoutePolicy(transactional=True)})


async def asgi_app(scope: Any, receive: Any, send: Any) -> None: ...


def wsgi_app(environ: Any, start_response: Any) -> list[bytes]:
    return []


BOOL = ["yes", "false", 0, 1, None]
INT = [1.5, True, "100", None, -1]
DURATION = [5, 0.5, "5s", True, None, timedelta(0), timedelta(seconds=-1)]
FUNCTION = ["user", 5, {}, None]
NAMES = [{"POST": 1}, 5, b"POST", None]
POLICY = [{}, {"/pay": RoutePolicy()}, "x", 5, RoutePolicy()]
TABLES = [{}, "x", 5, None]


@dataclasses.dataclass(frozen=True)
class Target:
    """A public constructor: ``make(**options)`` with its valid base options."""

    name: str
    make: Callable[..., Any]
    base: dict[str, Any]
    signature_of: Any = None
    """Whose parameters are its options (default: ``make``); ``"fields"``: a dataclass's."""


TARGETS = {
    "RoutePolicy": Target("RoutePolicy", RoutePolicy, {}, "fields"),
    "IdempotencyPolicy": Target("IdempotencyPolicy", IdempotencyPolicy, {}, "fields"),
    "IdempotencyPolicy.of": Target("IdempotencyPolicy.of", IdempotencyPolicy.of, {}),
    "IdempotencyMiddleware": Target(
        "IdempotencyMiddleware", IdempotencyMiddleware, {"app": asgi_app, "engine": ENGINE}
    ),
    "WSGIIdempotencyMiddleware": Target(
        "WSGIIdempotencyMiddleware", WSGIIdempotencyMiddleware, {"app": wsgi_app, "engine": ENGINE}
    ),
    "SqlStore": Target("SqlStore", SqlStore, {"engine": ENGINE}),
    "AsyncSqlStore": Target("AsyncSqlStore", AsyncSqlStore, {"engine": ASYNC_ENGINE}),
    "RedisStore": Target("RedisStore", RedisStore, {"client": REDIS}),
    "AsyncRedisStore": Target("AsyncRedisStore", AsyncRedisStore, {"client": ASYNC_REDIS}),
    "RedisStore.from_url": Target(
        "RedisStore.from_url", RedisStore.from_url, {"url": "redis://127.0.0.1:6379/0"}
    ),
    "AsyncRedisStore.from_url": Target(
        "AsyncRedisStore.from_url", AsyncRedisStore.from_url, {"url": "redis://127.0.0.1:6379/0"}
    ),
    "idempotent": Target("idempotent", idempotent, {}),
    "Idempotent": Target("Idempotent", Idempotent, {}),
    "TransactionalSession": Target("TransactionalSession", TransactionalSession, {}),
}
MIDDLEWARE = {
    "app": ["app", 5, None],
    "engine": ["postgresql://x", 5, {}],
    "store": ["redis://x", 5, {}],
    "policy": POLICY,
    "routes": ["/pay", 5, {"/pay": RoutePolicy()}, None],
    "principal": FUNCTION[:3],
    "tables": TABLES,
    "session_factory": FUNCTION[:3],
}
ROUTE_POLICY = {
    "methods": [*NAMES, "GET", ["POST", "PUT"], [], ["POST", 5]],
    "required": BOOL,
    "wait": [*DURATION[:5], timedelta(seconds=-1)],
    "expiry": [*DURATION, timedelta.max],
    "lease": [*DURATION, timedelta(milliseconds=1), timedelta(milliseconds=999), timedelta.max],
    "retry_after": [*DURATION, timedelta(milliseconds=10)],
    "max_stored_body": INT,
    "max_request_body": INT,
    "transactional": BOOL,
    "fingerprint": FUNCTION,
    "unstored_statuses": ["422", 422.5, True, {"a": 1}, [200], [500], [True], ["422"], None],
}
STORE = {"tables": TABLES, "clock": FUNCTION}
WALK: dict[str, dict[str, list[Any]]] = {
    "RoutePolicy": ROUTE_POLICY,
    "IdempotencyPolicy": {
        "default": [{}, "x", 5, None, IdempotencyPolicy()],
        "routes": ["/pay", 5, {"/pay": RoutePolicy()}, [("/pay", {})], [("pay", RoutePolicy())]],
    },
    "IdempotencyPolicy.of": {
        "routes": ["/pay", ["/pay"], 5, {"/pay": {}}, {"pay": RoutePolicy()}, {5: RoutePolicy()}],
        "default": [{}, "x", 5, IdempotencyPolicy()],
    },
    "IdempotencyMiddleware": MIDDLEWARE,
    "WSGIIdempotencyMiddleware": MIDDLEWARE,
    "SqlStore": {"engine": ["postgresql://x", 5, None, ASYNC_ENGINE], **STORE},
    "AsyncSqlStore": {"engine": ["postgresql://x", 5, None, ENGINE], **STORE},
    "RedisStore": {"client": ["redis://x", 5, None, ASYNC_REDIS], "prefix": ["", 5, b"x", None]},
    "AsyncRedisStore": {"client": ["redis://x", 5, None, REDIS], "prefix": ["", 5, b"x", None]},
    "RedisStore.from_url": {"url": [5, b"redis://x", "", None], "prefix": ["", 5, b"x"]},
    "AsyncRedisStore.from_url": {"url": [5, b"redis://x", "", None], "prefix": ["", 5, b"x"]},
    "idempotent": {"policy": [{}, "x", 5, IdempotencyPolicy()], "settings": []},
    "Idempotent": {"policy": [{}, "x", 5, IdempotencyPolicy()], "settings": []},
    "TransactionalSession": {"policy": [{}, "x", 5, IdempotencyPolicy()], "settings": []},
}


def label(value: object) -> str:
    """A short test id for a wrong value (a policy's repr runs to hundreds of characters)."""
    text = repr(value)
    return text if len(text) <= 40 else f"<{type(value).__name__}>"


CASES = [
    pytest.param(target, option, value, id=f"{target}.{option}={label(value)}")
    for target, options in WALK.items()
    for option, values in options.items()
    for value in values
]


@pytest.mark.parametrize(("target", "option", "value"), CASES)
def test_a_wrong_value_is_refused_at_construction_naming_the_option(
    target: str, option: str, value: object
) -> None:
    chosen = TARGETS[target]
    with pytest.raises(ConfigurationError) as refused:
        chosen.make(**{**chosen.base, option: value})
    assert option in str(refused.value), str(refused.value)


# The settings of idempotent() and its FastAPI twins are RoutePolicy's fields, each walked.
@pytest.mark.parametrize("target", ["idempotent", "Idempotent", "TransactionalSession"])
@pytest.mark.parametrize(
    ("option", "value"),
    [(option, values[0]) for option, values in ROUTE_POLICY.items() if option != "transactional"]
    + [("lease", timedelta(milliseconds=1)), ("no_such_option", 1)],
)
def test_the_decorators_refuse_what_route_policy_refuses(
    target: str, option: str, value: object
) -> None:
    with pytest.raises(ConfigurationError) as refused:
        TARGETS[target].make(**{option: value})
    assert option in str(refused.value), str(refused.value)


def test_a_transactional_session_that_is_not_transactional_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="transactional"):
        TransactionalSession(transactional=False)


@pytest.mark.parametrize("middleware", [IdempotencyMiddleware, WSGIIdempotencyMiddleware])
def test_a_transactional_route_on_a_store_without_an_engine_is_refused_at_construction(
    middleware: Any,
) -> None:
    app = asgi_app if middleware is IdempotencyMiddleware else wsgi_app
    store = RedisStore(REDIS)
    with pytest.raises(ConfigurationError, match="transactional"):
        middleware(app, store=store, policy=TRANSACTIONAL)

    class Route:  # a marked route already on the app when the middleware is made
        path = "/pay"

        @staticmethod
        @idempotent(transactional=True)
        def endpoint() -> None: ...

    with pytest.raises(ConfigurationError, match="transactional"):
        middleware(app, store=store, routes=[Route()])


@pytest.mark.parametrize("fields", [(), ("",), (5,), (["amount"],), ("amount", None)], ids=repr)
def test_json_fields_refuses_what_is_not_a_field_name(fields: tuple[object, ...]) -> None:
    with pytest.raises(ConfigurationError, match="json_fields"):
        json_fields(*fields)  # type: ignore[arg-type]


def test_the_valid_base_options_are_accepted() -> None:
    """So that every refusal above is the walked option's, not the base's."""
    for target in TARGETS.values():
        target.make(**target.base)


def test_every_option_is_walked() -> None:
    for name, target in TARGETS.items():
        if target.signature_of == "fields":
            options = {f.name for f in dataclasses.fields(target.make)}  # type: ignore[arg-type]
        else:
            parameters = inspect.signature(target.make).parameters.values()
            options = {p.name for p in parameters if p.name not in ("self", "cls")}
        assert options == set(WALK[name]), name


def test_the_policy_default_is_checked_like_a_route() -> None:
    """Issue 38 item 1 on the policy's default: a lease too short to hold is refused there too,
    and ``IdempotencyPolicy.of(routes, default={})`` no longer falls back silently."""
    with pytest.raises(ConfigurationError, match="lease"):
        IdempotencyPolicy.of(default=RoutePolicy(lease=timedelta(milliseconds=1)))
    with pytest.raises(ConfigurationError, match="default"):
        IdempotencyPolicy.of({"/pay": RoutePolicy()}, default={})  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="default"):
        IdempotencyPolicy(default={})  # type: ignore[arg-type]


def test_a_marked_route_whose_path_can_never_match_is_refused_naming_routes() -> None:
    class Route:
        path = "/pay "

        @staticmethod
        @idempotent(required=True)
        def endpoint() -> None: ...

    with pytest.raises(ConfigurationError, match=r"routes .*can never match"):
        IdempotencyMiddleware(asgi_app, ENGINE, routes=[Route()])
