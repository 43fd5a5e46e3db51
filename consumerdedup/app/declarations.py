"""What an App declares, checked when it is declared: each consumer, the relay, the pruner.

A consumer's keyword options go to the config its runner already has (KafkaConfig,
RabbitConfig: validated there) and to its Deduplicator (``retry``, ``claim_first``,
``dead_letter``, ``observers``); ``group_id`` to the Kafka runner and ``before_ack``
(a test hook) to any. An option none of them knows is a ConfigurationError naming it
and the known ones, at declaration, not at the first message.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from .. import options
from ..dedup.async_deduplicator import AsyncBulkDedupHandler, AsyncDedupHandler
from ..dedup.deduplicator import BulkDedupHandler, DedupHandler
from ..dedup.handler_kinds import kind
from ..errors import ConfigurationError
from ..outbox.relay_config import RelayConfig
from ..prune.config import PrunerConfig
from ..retry import RetryPolicy
from .typed_bodies import typed, where

KAFKA, RABBITMQ = "kafka", "rabbitmq"
WRAPPED = (DedupHandler, AsyncDedupHandler, BulkDedupHandler, AsyncBulkDedupHandler)
"""Handlers a Deduplicator already wrapped: taken as they are (their consumer, engine)."""
DEDUP_OPTIONS = ("retry", "claim_first", "dead_letter", "observers")
RUNNER_OPTIONS = ("before_ack",)


def _config_class(broker: str) -> type[Any]:
    """The adapter's config class; importing the adapter says which extra is missing."""
    adapter = "kafka" if broker == KAFKA else "rabbitmq"
    module = importlib.import_module(f"consumerdedup.adapters.{adapter}.config")
    return module.KafkaConfig if broker == KAFKA else module.RabbitConfig  # type: ignore[no-any-return]


def fields_of(cls: type[Any]) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.init)


@dataclass(frozen=True)
class ConsumerDeclaration:
    """One consumer: its name (its dedup records' and its part's), source and handler."""

    name: str
    broker: str
    sources: tuple[str, ...]
    handler: Any
    """The function to wrap (typed bodies parsed), or a handler a Deduplicator wrapped."""
    bulk: bool
    config: Any
    """KafkaConfig or RabbitConfig."""
    dedup: Mapping[str, Any] = field(default_factory=dict)
    group_id: str | None = None
    before_ack: Callable[..., Any] | None = None

    @property
    def is_async(self) -> bool:
        return kind(getattr(self.handler, "fn", self.handler)) == "coroutine"

    @property
    def wrapped(self) -> bool:
        return isinstance(self.handler, WRAPPED)


def _kafka_topics(cls: type, config: Any, sources: tuple[str, ...], name: str) -> None:
    """The topics in Kafka's syntax, and their dead-letter topics nameable."""
    module = importlib.import_module(cls.__module__)
    for index, topic in enumerate(sources):  # the runner's rule: the length is the broker's
        where = f"consumer {name!r} topics[{index}]"
        options.matching(topic, where, module.CONSUMED_TOPIC, module.CONSUMED_RULE)
    config.check_dead_letters(sources)


def declare_consumer(
    fn: Any,
    *,
    broker: str,
    consumer: object,
    sources: tuple[str, ...],
    bulk: object,
    given: dict[str, Any],
) -> ConsumerDeclaration:
    """The declaration of ``fn``; ConfigurationError for anything wrong in it."""
    name = options.text(consumer, "consumer", max_length=255)
    bulk = options.boolean(bulk, "bulk")
    cls = _config_class(broker)
    known = (*fields_of(cls), "config", *DEDUP_OPTIONS, *RUNNER_OPTIONS)
    if broker == KAFKA:
        known = (*known, "group_id")
    given = options.mapping(given, f"options of consumer {name!r}", allowed=known,
                            allowed_are="one of " + ", ".join(known))  # fmt: skip
    config = given.pop("config", None)
    settings = {key: given.pop(key) for key in fields_of(cls) if key in given}
    if config is not None and settings:
        raise ConfigurationError(
            f"consumer {name!r}: give config={cls.__name__}(...) or its fields "
            f"({', '.join(settings)}), not both"
        )
    if config is None:
        config = cls(**settings)
    options.instance(config, f"consumer {name!r} config", cls, f"a {cls.__name__}")
    dedup = {key: given.pop(key) for key in DEDUP_OPTIONS if key in given}
    if "retry" in dedup:
        options.instance(dedup["retry"], "retry", RetryPolicy, "a RetryPolicy")
    if "claim_first" in dedup:
        options.boolean(dedup["claim_first"], "claim_first")
    # What the Deduplicator and the runner check again when built, checked here too: an
    # App's declaration is where the option is given (a topic 'a b' or observers='x' were
    # accepted and refused only when the worker built the part).
    if "observers" in dedup:
        options.functions(dedup["observers"], "observers", "a callable taking a Result")
    if "dead_letter" in dedup:
        options.maybe(dedup["dead_letter"], "dead_letter", options.function)
    if broker == KAFKA:
        _kafka_topics(cls, config, sources, name)
    before_ack = given.pop("before_ack", None)
    group_id = options.maybe(given.pop("group_id", None), "group_id", options.text)
    if isinstance(fn, WRAPPED):
        handler = _wrapped(fn, name, bulk, dedup)
    else:
        handler = typed(fn, bulk=bulk, consumer=name)
    return ConsumerDeclaration(
        name, broker, sources, handler, bulk, config, dedup, group_id, before_ack
    )


def _wrapped(handler: Any, name: str, bulk: bool, dedup: Mapping[str, Any]) -> Any:
    """A handler wrapped already: its consumer must be the one declared."""
    own = handler.dedup.consumer
    is_bulk = isinstance(handler, BulkDedupHandler | AsyncBulkDedupHandler)
    if own != name or is_bulk != bulk or dedup:
        raise ConfigurationError(
            f"handler {where(handler.fn)} is wrapped by a Deduplicator of consumer {own!r} "
            f"({'bulk' if is_bulk else 'per message'}): declare it with consumer={own!r}, "
            f"bulk={is_bulk} and no Deduplicator options, or declare the plain function"
        )
    return handler


@dataclass(frozen=True)
class RelayDeclaration:
    name: str
    to: str
    config: RelayConfig
    publisher_options: Mapping[str, Any]


def declare_relay(name: object, to: object, given: dict[str, Any]) -> RelayDeclaration:
    part = options.text(name, "relay(name)")
    broker = options.choice(to, "relay(to)", (KAFKA, RABBITMQ))
    known = (*fields_of(RelayConfig), "config", "publisher_options")
    given = options.mapping(given, "relay options", allowed=known,
                            allowed_are="one of " + ", ".join(known))  # fmt: skip
    config = given.pop("config", None)
    if config is None:
        config = RelayConfig(**{k: given.pop(k) for k in fields_of(RelayConfig) if k in given})
    elif set(given) - {"publisher_options"}:
        raise ConfigurationError("relay: give config=RelayConfig(...) or its fields, not both")
    options.instance(config, "relay(config)", RelayConfig, "a RelayConfig")
    publisher = options.mapping(given.pop("publisher_options", {}), "relay(publisher_options)")
    _check_publisher_options(broker, publisher)
    return RelayDeclaration(part, broker, config, publisher)


PUBLISHER_ADDRESS = {KAFKA: "bootstrap_servers", RABBITMQ: "url"}
"""The publisher's address keyword: the App gives it from the settings, never the options."""


def _check_publisher_options(broker: str, given: Mapping[str, Any]) -> None:
    """The publisher's keywords, checked by its own constructor now (it does not connect;
    its address is the default one here): a misspelt keyword or a wrong value was
    accepted and broke the relay only when the worker built it, a crash restarted until
    the worker gave up."""
    address = PUBLISHER_ADDRESS[broker]
    if address in given:
        variable = "KAFKA_BOOTSTRAP_SERVERS" if broker == KAFKA else "RABBITMQ_URL"
        raise ConfigurationError(
            f"relay(publisher_options): {address!r} is the publisher's address, which the "
            f"app takes from CONSUMERDEDUP_{variable}: set it there"
        )
    adapter = importlib.import_module(f"consumerdedup.adapters.{broker}")
    publisher = adapter.KafkaPublisher if broker == KAFKA else adapter.RabbitPublisher
    known = [
        name
        for name, p in inspect.signature(publisher).parameters.items()
        if p.kind is p.KEYWORD_ONLY
    ]
    if unknown := sorted(set(given) - set(known)):
        raise ConfigurationError(
            f"relay(publisher_options): no option {unknown[0]!r} for {publisher.__name__} "
            f"(its options: {', '.join(known)})"
        )
    publisher(**given)


@dataclass(frozen=True)
class PrunerDeclaration:
    """``windows``: a consumer's own window (beats the broker's); ``retention``: the window
    of the consumers whose broker does not say; the rest as PrunerConfig takes it."""

    name: str
    every: timedelta
    retention: timedelta | None
    windows: Mapping[str, timedelta | None]
    settings: Mapping[str, Any]


PRUNER_SETTINGS = ("buffer", "outbox_keep", "idempotency_keep", "batch_size", "batch_pause")


def declare_pruner(
    name: object, every: object, retention: object, windows: object, given: dict[str, Any]
) -> PrunerDeclaration:
    part = options.text(name, "pruner(name)")
    period = options.duration(every, "pruner(every)")
    window = options.maybe(retention, "pruner(retention)", options.duration)
    own = options.mapping(windows or {}, "pruner(windows)")
    given = options.mapping(given, "pruner options", allowed=PRUNER_SETTINGS,
                            allowed_are="one of " + ", ".join(PRUNER_SETTINGS))  # fmt: skip
    PrunerConfig(window or timedelta(days=1), windows=own, **given)  # checked now, built later
    return PrunerDeclaration(part, period, window, own, given)
