"""Round 9, fresh eyes on Invariant 10: values right by type that no clock or database can
take. Every duration option refuses one past a century and every integer option one past
a bigint, at construction (consumerdedup.options: LONGEST_DURATION, LARGEST_INTEGER).

Seen failing before the fix, for example: ``RetryPolicy(initial_delay=timedelta.max,
max_delay=timedelta.max)`` was accepted and the first failed attempt of a message raised
OverflowError out of the handler call; ``RelayConfig(batch_size=10**30)`` and
``Pruner(batch_size=10**30)`` were accepted and the first round died with the driver's
"bigint out of range"; ``RelayConfig(poll_interval=timedelta.max)``,
``RoutePolicy(wait=timedelta.max)`` and the other waits were accepted as well.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import typing
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from consumerdedup import ConfigurationError, RetryPolicy
from consumerdedup.http import RoutePolicy
from consumerdedup.options import LARGEST_INTEGER, LONGEST_DURATION
from tests.core.test_option_walk import CONFIGS, SKIPPED_FIELDS, kind_of

TOO_LONG = [timedelta.max, timedelta(days=10**6), LONGEST_DURATION + timedelta(seconds=1)]
TOO_BIG = [10**30, LARGEST_INTEGER + 1]
ALL_CONFIGS: dict[type, dict[str, object]] = {**CONFIGS, RoutePolicy: {}}


def cases() -> Iterator[Any]:
    for cls, base in ALL_CONFIGS.items():
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if not field.init or (cls.__name__, field.name) in SKIPPED_FIELDS:
                continue
            try:
                kind, _ = kind_of(hints[field.name])
            except AssertionError:  # a kind with no duration or integer in it (frozenset)
                continue
            values = {"duration": TOO_LONG, "integer": TOO_BIG}.get(kind, [])
            for value in values:
                yield pytest.param(
                    cls, base, field.name, value, id=f"{cls.__name__}.{field.name}={value!r}"
                )


@pytest.mark.parametrize(("cls", "base", "name", "value"), list(cases()))
def test_a_value_no_clock_or_database_takes_is_refused(
    cls: type, base: dict[str, object], name: str, value: object
) -> None:
    given = {**base, name: value}
    with pytest.raises(ConfigurationError) as caught:
        cls(**given)
    said = str(caught.value)
    assert f"{cls.__name__}.{name}" in said, said
    assert any(bound in said for bound in ("at most", "<=", "an integer from")), said


def test_the_walk_reaches_the_waits_and_sizes() -> None:
    """The cases above include the options of the holes seen, found by their type hints."""
    found = {case.id.split("=")[0] for case in cases()}
    for option in (
        "RetryPolicy.initial_delay",
        "RetryPolicy.max_delay",
        "RelayConfig.poll_interval",
        "RelayConfig.batch_size",
        "PrunerConfig.batch_size",
        "RoutePolicy.wait",
        "RoutePolicy.retry_after",
        "KafkaConfig.retry_delay",
        "RabbitConfig.idle_timeout",
    ):
        assert option in found


def test_the_longest_values_taken_can_be_waited_on() -> None:
    """At the bounds: a century's retry delay is taken, and the longest wait it makes
    (doubled past its cap, plus jitter) is one threading and time.sleep can wait for."""
    policy = RetryPolicy(attempts=2, initial_delay=LONGEST_DURATION, max_delay=LONGEST_DURATION)
    assert policy.max_delay == LONGEST_DURATION
    assert policy.backoff().delay(64) < threading.TIMEOUT_MAX
    assert RetryPolicy(attempts=LARGEST_INTEGER).attempts == LARGEST_INTEGER


SECRET = "pw-r9-secret"


def _url_options() -> list[Any]:
    from consumerdedup import App
    from consumerdedup.adapters.rabbitmq import RabbitConsumerRunner, RabbitPublisher

    def runner(url: object) -> object:
        from sqlalchemy import create_engine

        from consumerdedup import Deduplicator

        dedup = Deduplicator(create_engine("sqlite://"), consumer="secrets")
        handler = dedup.handler(lambda message, session: None)
        return RabbitConsumerRunner(handler, "orders", url=url)  # type: ignore[arg-type]

    return [
        pytest.param(lambda url: RabbitPublisher(url), "RabbitPublisher.url", id="RabbitPublisher"),
        pytest.param(runner, "RabbitConsumerRunner.url", id="RabbitConsumerRunner"),
        pytest.param(
            lambda url: App("shop", database_url=url), "App(database_url)", id="App.database_url"
        ),
    ]


@pytest.mark.parametrize(("build", "option"), _url_options())
@pytest.mark.parametrize(
    "url",
    [f"amqp://shop:{SECRET}@host/\x00", f"postgresql://shop:{SECRET}@host/db\x00".encode()],
    ids=["a NUL", "bytes"],
)
def test_a_refused_url_is_never_quoted(build: Any, option: str, url: object) -> None:
    """Invariant 6: a URL refused at construction is named, its password never shown.
    Seen failing before the fix: the NUL check quoted the whole URL, password and all."""
    with pytest.raises(ConfigurationError) as caught:
        build(url)
    said = str(caught.value)
    assert option in said and SECRET not in said, said


async def _coroutine_function(*args: object) -> str:
    return "never run"


class _AsyncCallable:
    async def __call__(self, *args: object) -> str:
        return "never run"


ASYNC_CALLABLES = [
    pytest.param(_coroutine_function, id="async def"),
    pytest.param(_AsyncCallable(), id="async __call__"),
    pytest.param(functools.partial(_coroutine_function, 1), id="partial of an async def"),
]


def _called_without_await() -> list[Any]:
    from sqlalchemy import create_engine

    from consumerdedup import Deduplicator, Pruner
    from consumerdedup.http import IdempotencyMiddleware, WSGIIdempotencyMiddleware

    engine = create_engine("sqlite://")

    async def asgi(scope: object, receive: object, send: object) -> None: ...

    def wsgi(environ: object, start_response: object) -> list[bytes]:
        return []

    day = timedelta(days=1)
    asgi_mw, wsgi_mw = IdempotencyMiddleware, WSGIIdempotencyMiddleware
    return [
        ("Deduplicator.dead_letter", lambda f: Deduplicator(engine, consumer="c", dead_letter=f)),
        ("RoutePolicy.fingerprint", lambda f: RoutePolicy(fingerprint=f)),
        ("IdempotencyMiddleware.principal", lambda f: asgi_mw(asgi, engine, principal=f)),
        (
            "IdempotencyMiddleware.session_factory",
            lambda f: asgi_mw(asgi, engine, session_factory=f),
        ),
        ("WSGIIdempotencyMiddleware.principal", lambda f: wsgi_mw(wsgi, engine, principal=f)),
        ("Pruner.progress", lambda f: Pruner(engine, day, progress=f)),
        ("Pruner.clock", lambda f: Pruner(engine, day, clock=f)),
    ]


@pytest.mark.parametrize("callback", ASYNC_CALLABLES)
@pytest.mark.parametrize(
    ("option", "build"), _called_without_await(), ids=[o for o, _ in _called_without_await()]
)
def test_an_async_callback_called_without_await_is_refused(
    option: str, build: Any, callback: object
) -> None:
    """Seen failing before the fix: each was accepted; a blocking Deduplicator's async
    dead_letter was called, its coroutine never awaited, and the FAILED message was
    reported (and acked by a runner) with no dead letter sent; the HTTP ones broke at
    every request."""
    with pytest.raises(ConfigurationError) as caught:
        build(callback)
    said = str(caught.value)
    assert option in said and "async" in said, said


def test_an_async_dead_letter_is_still_taken_where_it_is_awaited() -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    from consumerdedup import AsyncDeduplicator, Deduplicator

    engine = create_async_engine("sqlite+aiosqlite://")
    dedup = AsyncDeduplicator(engine, consumer="c", dead_letter=_coroutine_function)
    assert dedup.dead_letter is _coroutine_function
    plain = Deduplicator(engine.sync_engine, consumer="c", dead_letter=print)
    assert plain.dead_letter is print


LONE = "pay\ud800ments"


def _named_options() -> list[Any]:
    from sqlalchemy import create_engine

    from consumerdedup import Deduplicator, Pruner
    from consumerdedup.adapters.rabbitmq import RabbitConfig

    engine, day = create_engine("sqlite://"), timedelta(days=1)
    return [
        pytest.param(lambda: Pruner(engine, day, consumers=LONE), "consumers", id="consumers"),
        pytest.param(
            lambda: Pruner(engine, day, consumers=["a", LONE]), "consumers[1]", id="consumers[1]"
        ),
        pytest.param(lambda: Pruner(engine, day, windows={LONE: day}), "windows key", id="windows"),
        pytest.param(
            lambda: RabbitConfig(dead_letter_queue=LONE), "dead_letter_queue", id="rabbit dlq"
        ),
        pytest.param(lambda: Deduplicator(engine, consumer=LONE), "consumer", id="Deduplicator"),
    ]


@pytest.mark.parametrize(("build", "option"), _named_options())
def test_a_name_with_a_lone_surrogate_is_refused_at_construction(build: Any, option: str) -> None:
    """Seen failing before the fix: ``Pruner(consumers="pay\\ud800ments")`` (and its
    windows' keys) was accepted and its first prune() died with UnicodeEncodeError."""
    with pytest.raises(ConfigurationError) as caught:
        build()
    assert option in str(caught.value), caught.value


def _app_declarations() -> list[Any]:
    def handle(message: object, session: object) -> None: ...

    def kafka(**given: Any) -> object:
        from consumerdedup import App

        return App("shop").kafka(consumer="orders", **given)(handle)

    def rabbit(**given: Any) -> object:
        from consumerdedup import App

        return App("shop").rabbitmq(consumer="orders", queue="orders", **given)(handle)

    return [
        pytest.param(lambda: kafka(topics="a b"), "topics[0]", id="topic with a space"),
        pytest.param(lambda: kafka(topics=["orders", ".."]), "topics[1]", id="topic '..'"),
        pytest.param(lambda: kafka(topics="x" * 249), "dead-letter topic", id="no DLT name"),
        pytest.param(lambda: rabbit(observers="print"), "observers", id="observers a str"),
        pytest.param(lambda: rabbit(dead_letter="x"), "dead_letter", id="dead_letter a str"),
    ]


@pytest.mark.parametrize(("declare", "said"), _app_declarations())
def test_an_app_consumer_is_checked_where_it_is_declared(declare: Any, said: str) -> None:
    """Seen failing before the fix: each declaration was accepted; the worker refused it
    only when it built the part (the runner's or the Deduplicator's own check)."""
    with pytest.raises(ConfigurationError) as caught:
        declare()
    assert said in str(caught.value), caught.value
