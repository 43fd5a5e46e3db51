"""Invariant 10, walked: every option of every public constructor refuses a wrong-typed
value with a ConfigurationError naming the option and what was given.

The options are found, not listed: a config dataclass's fields and a constructor's
keyword parameters, each by its type hint. A new option is walked as soon as it is
added, and a public class that is neither walked nor declared "not configured by
options" fails ``test_every_public_class_is_walked_or_excused``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import consumerdedup
import consumerdedup.outbox
import consumerdedup.prune
import consumerdedup.testing
from consumerdedup import (
    AsyncDeduplicator,
    ConfigurationError,
    Deduplicator,
    Outbox,
    OutboxRelay,
    Pruner,
    PrunerConfig,
    RelayConfig,
    RetryPolicy,
    Tables,
    install,
)
from consumerdedup.retry import Backoff
from consumerdedup.testing import MemoryBroker, MemoryConfig, MemoryConsumerRunner

kafka = pytest.importorskip("consumerdedup.adapters.kafka")
telemetry = pytest.importorskip("consumerdedup.telemetry")
prometheus = pytest.importorskip("consumerdedup.telemetry.prometheus")
rabbitmq = pytest.importorskip("consumerdedup.adapters.rabbitmq")

DAY = timedelta(days=1)

WRONG: dict[str, list[object]] = {
    # a string for a bool, a number for a bool, None where None means nothing
    "boolean": ["false", "no", 0, 1, None],
    # a float, a bool, a numeric string for an int
    "integer": [1.5, True, "100", None],
    "number": ["0.5", True, None],
    # a number where a duration is not documented in seconds, a string, a bool
    "duration": [5, 0.5, "5s", True],
    "text": [5, b"name", ["a"]],
    # a dict, a number, bytes for a collection of names (a str is ONE name: accepted)
    "names": [{"a": 1}, 5, b"ab"],
    "mapping": ["x=1", ["a"], 5],
    "function": ["handler", 5, {}],
    "exceptions": ["ValueError", 5, {"a": 1}, (ValueError, "x")],
    # a dict where a policy, config or table set belongs, a string, a number
    "instance": [{}, "x", 5],
}


def kind_of(hint: Any) -> tuple[str, bool]:
    """The kind of value a type hint asks for (a key of WRONG), and whether None is allowed."""
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        optional = type(None) in args
        rest = [a for a in args if a is not type(None)]
        for preferred in (timedelta, bool, int):  # Window: timedelta | BrokerRetention | None
            if preferred in rest:
                return kind_of(preferred)[0], optional
        if str in rest and len(rest) == 2 and typing.get_origin(rest[1]) is not None:
            return "names", optional  # str | Sequence[str]: one name or several
        return kind_of(rest[0])[0], optional
    if hint is bool:
        return "boolean", False
    if hint is int:
        return "integer", False
    if hint is float:
        return "number", False
    if hint is timedelta:
        return "duration", False
    if hint is str:
        return "text", False
    if origin in (Mapping, dict) or hint is Mapping:
        return "mapping", False
    if origin is tuple and args and typing.get_origin(args[0]) is type:
        return "exceptions", False
    if origin in (typing.Sequence, typing.Iterable, tuple, list, Iterator) or str(origin) in (
        "<class 'collections.abc.Iterable'>",
        "<class 'collections.abc.Sequence'>",
    ):
        return "names", False
    if origin is Callable or str(origin) == "<class 'collections.abc.Callable'>":
        return "function", False
    if isinstance(hint, type):
        return "instance", False
    raise AssertionError(f"no wrong values known for the hint {hint!r}: add its kind to WRONG")


def refuses(build: Callable[[], object], option: str, value: object) -> None:
    with pytest.raises(ConfigurationError) as caught:
        build()
    said = str(caught.value)
    assert option in said, f"{option}={value!r}: the error does not name the option: {said}"
    # What was given: the value, or the element of it that is wrong.
    shown = [value, *(value if isinstance(value, tuple | list) else ())]
    kinds = [type(v).__name__ for v in shown]  # a secret's value is never quoted: its type is
    assert any(f"({k})" in said or f"got a {k}" in said for k in kinds), f"{value!r}: {said}"


# The config dataclasses, with what their required fields need.
CONFIGS: dict[type, dict[str, object]] = {
    RelayConfig: {},
    PrunerConfig: {"retention": DAY},
    RetryPolicy: {},
    Backoff: {"first": timedelta(1), "longest": timedelta(2)},
    MemoryConfig: {},
    kafka.KafkaConfig: {},
    rabbitmq.RabbitConfig: {},
}
SKIPPED_FIELDS = {("PrunerConfig", "keep")}  # derived, init=False


def config_cases() -> Iterator[Any]:
    for cls, base in CONFIGS.items():
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if not field.init or (cls.__name__, field.name) in SKIPPED_FIELDS:
                continue
            kind, optional = kind_of(hints[field.name])
            for value in WRONG[kind]:
                if value is None and optional:
                    continue
                yield pytest.param(
                    cls, base, field.name, value, id=f"{cls.__name__}.{field.name}={value!r}"
                )


@pytest.mark.parametrize(("cls", "base", "name", "value"), list(config_cases()))
def test_config_field_refuses_a_wrong_value(
    cls: type, base: dict[str, object], name: str, value: object
) -> None:
    refuses(lambda: cls(**{**base, name: value}), name, value)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, AsyncEngine]]:
    path = Path(tmp_path_factory.mktemp("walk")) / "walk.db"
    engine = create_engine(f"sqlite:///{path}")
    async_engine = create_async_engine(f"sqlite+aiosqlite:///{path}")
    yield engine, async_engine
    engine.dispose()


def constructors(
    engine: Engine, async_engine: AsyncEngine
) -> dict[str, tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]]:
    """Each public constructor that takes options, with arguments that it accepts."""
    dedup = Deduplicator(engine, "walk")
    adedup = AsyncDeduplicator(async_engine, "walk")
    handler = dedup.handler(lambda message, session: None)
    return {
        "Deduplicator": (Deduplicator, (engine, "walk"), {}),
        "AsyncDeduplicator": (AsyncDeduplicator, (async_engine, "walk"), {}),
        "Deduplicator.handler": (dedup.handler, (), {}),
        "AsyncDeduplicator.handler": (adedup.handler, (), {}),
        "Outbox": (Outbox, (), {}),
        "OutboxRelay": (OutboxRelay, (engine, MemoryBroker()), {}),
        "Pruner": (Pruner, (engine, DAY), {}),
        "Tables.define": (Tables.define, (), {}),
        "install": (install, (engine,), {}),
        "MemoryBroker": (MemoryBroker, (), {}),
        "MemoryConsumerRunner": (MemoryConsumerRunner, (handler, "q"), {"broker": MemoryBroker()}),
        "KafkaConsumerRunner": (kafka.KafkaConsumerRunner, (handler, "t"), {}),
        "KafkaPublisher": (kafka.KafkaPublisher, (), {}),
        "RabbitConsumerRunner": (rabbitmq.RabbitConsumerRunner, (handler, "q"), {}),
        "RabbitPublisher": (rabbitmq.RabbitPublisher, (), {}),
        "App": (consumerdedup.App, ("walk",), {}),
        "ProcessOnce": (consumerdedup.ProcessOnce, (handler,), {}),
        "AsyncProcessOnce": (consumerdedup.AsyncProcessOnce, (handler,), {}),
        "observe_tables": (telemetry.observe_tables, (engine,), {}),
        "serve": (prometheus.serve, (0, engine, Tables.define()), {}),
    }


NOT_WALKED = {
    ("observe_tables", "meter_provider"),  # OpenTelemetry's own object, any of its kinds
    ("OutboxRelay", "publisher"),  # a duck-typed Publisher: walked below by hand
    ("Pruner", "clock"),
    ("Pruner", "retention"),  # PrunerConfig's: walked with it
    ("Pruner", "buffer"),
    ("Pruner", "settings"),
}
EXTRA_HINTS = {"Window": timedelta}


def hints_of(target: Callable[..., Any]) -> dict[str, Any]:
    """The parameters' type hints; one that names what only type checkers import is left out
    (``**settings: Unpack[...]``: walked as PrunerConfig's fields)."""
    try:
        return typing.get_type_hints(target)
    except NameError:
        found = {}
        for name, text in inspect.get_annotations(target).items():
            try:
                found[name] = eval(text, target.__globals__)
            except NameError:
                continue
        return found


def parameters(build: Callable[..., Any]) -> Iterator[tuple[str, Any]]:
    target = build.__init__ if isinstance(build, type) else build  # type: ignore[misc]
    hints = hints_of(inspect.unwrap(target))
    for name, parameter in inspect.signature(build).parameters.items():
        if parameter.kind in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL):
            continue
        if name in hints and hints[name] is not Any:
            yield name, hints[name]


LABELS = [
    "Deduplicator",
    "AsyncDeduplicator",
    "Deduplicator.handler",
    "AsyncDeduplicator.handler",
    "Outbox",
    "OutboxRelay",
    "Pruner",
    "Tables.define",
    "install",
    "MemoryBroker",
    "MemoryConsumerRunner",
    "KafkaConsumerRunner",
    "KafkaPublisher",
    "RabbitConsumerRunner",
    "RabbitPublisher",
    "App",
    "ProcessOnce",
    "AsyncProcessOnce",
    "observe_tables",
    "serve",
]


def test_every_constructor_is_walked(engines: tuple[Engine, AsyncEngine]) -> None:
    assert sorted(constructors(*engines)) == sorted(LABELS)


@pytest.mark.parametrize("label", LABELS)
def test_constructor_options_refuse_wrong_values(
    engines: tuple[Engine, AsyncEngine], label: str
) -> None:
    """Each option of the constructor, with every wrong value of its kind."""
    walked = 0
    build, args, kwargs = constructors(*engines)[label]
    signature = inspect.signature(build).parameters
    names = list(signature)
    for name, hint in parameters(build):
        if (label, name) in NOT_WALKED:
            continue
        kind, optional = kind_of(hint)
        if kind == "instance" and hint is Engine:
            wrong: list[object] = [engines[1], "sqlite://"]
        elif kind == "instance" and hint is AsyncEngine:
            wrong = [engines[0], "sqlite://"]
        else:
            wrong = [v for v in WRONG[kind] if not (v is None and optional)]
        position = names.index(name)
        for value in wrong:
            if position < len(args) or signature[name].kind is inspect.Parameter.POSITIONAL_ONLY:
                call_args = (*args[:position], value, *args[position + 1 :])
                call_kwargs = kwargs
            else:
                call_args, call_kwargs = args, {**kwargs, name: value}
            call: Callable[[], object] = functools.partial(build, *call_args, **call_kwargs)
            refuses(call, name, value)
            walked += 1
    assert walked >= 3


def test_a_publisher_that_cannot_publish_is_refused(engines: tuple[Engine, AsyncEngine]) -> None:
    relay: Any = OutboxRelay
    values: list[object] = ["x", {}, 5]
    for value in values:
        refuses(functools.partial(relay, engines[0], value), "publisher", value)


OPTIONS_FREE = {
    # values the library makes and hands out, errors, protocols and type aliases
    "Message",
    "Outcome",
    "Result",
    "OutcomeCounts",
    "PruneReport",
    "DedupHandler",
    "AsyncDedupHandler",
    "BulkDedupHandler",
    "AsyncBulkDedupHandler",
    "Publisher",
    "AsyncPublisher",
    "KeyFunction",
    "Delivery",
    "LockTableFull",
}


@pytest.mark.parametrize(
    "module",
    [
        consumerdedup,
        consumerdedup.outbox,
        consumerdedup.prune,
        consumerdedup.testing,
        kafka,
        rabbitmq,
    ],
    ids=lambda m: m.__name__,
)
def test_every_public_class_is_walked_or_excused(module: types.ModuleType) -> None:
    # A constructor's class (Tables for Tables.define), or a config walked field by field.
    walked = {c.__name__ for c in CONFIGS} | {label.partition(".")[0] for label in LABELS}
    for name in module.__all__:
        value = getattr(module, name)
        if not isinstance(value, type) or issubclass(value, BaseException):
            continue
        assert name in walked or name in OPTIONS_FREE, (
            f"{module.__name__}.{name} is public and takes arguments: walk its options here"
        )


def test_install_refuses_what_is_not_tables(engines: tuple[Engine, AsyncEngine]) -> None:
    with pytest.raises(ConfigurationError, match="tables"):
        install(engines[0], "x")  # type: ignore[arg-type]
    for bind in ("sqlite://", engines[1], None):
        with pytest.raises(ConfigurationError, match="bind"):
            install(bind)  # type: ignore[arg-type]
