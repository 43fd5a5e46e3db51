"""The pruner's windows for the app's consumers, read from their brokers as ``prune`` does.

Each consumer's window: its own in ``pruner(windows=...)`` if given, else the retention
its broker reports for its topics (retention.ms + segment.ms) or queues (message TTL),
else ``pruner(retention=...)``; a broker that does not say, with no retention given, is
a ConfigurationError naming the consumer and the fix. A broker's window applies only
to the consumers of its sources (Invariant 7): the round is restricted to the app's
consumers, each by its own window.
"""

from __future__ import annotations

import concurrent.futures
import importlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ..errors import ConfigurationError
from ..event_loop import loop_running
from ..prune.config import PrunerConfig
from ..prune.windows import BrokerRetention, RetentionUnknown, Window
from .declarations import KAFKA, ConsumerDeclaration, PrunerDeclaration
from .resources import Resources

T = TypeVar("T")


def off_the_loop(blocking: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``blocking(*args, **kwargs)``; in a thread of its own when an event loop runs in this
    one. The Kafka helpers run a loop of their own and refuse inside a running one
    (event_loop.run_blocking); App.check() and the pruner's windows are blocking calls
    (their database checks block the caller too), so from asyncio code they answer as
    from a thread rather than report the refusal."""
    if not loop_running():
        return blocking(*args, **kwargs)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="consumerdedup-check") as pool:
        return pool.submit(blocking, *args, **kwargs).result()


def broker_retention(consumer: ConsumerDeclaration, resources: Resources) -> BrokerRetention:
    """What the consumer's broker says of its sources (RetentionUnknown if it does not)."""
    if consumer.broker == KAFKA:
        kafka = importlib.import_module("consumerdedup.adapters.kafka.retention")
        options = dict(consumer.config.consumer_options)
        client = {k: v for k, v in options.items() if k.startswith(("security", "sasl", "ssl"))}
        found: BrokerRetention = off_the_loop(
            kafka.kafka_retention,
            resources.kafka_bootstrap(),
            list(consumer.sources),
            client_options=client,
        )
        return found
    rabbit = importlib.import_module("consumerdedup.adapters.rabbitmq.retention")
    found = rabbit.rabbitmq_retention(resources.rabbitmq_url(), list(consumer.sources))
    return found


def window_of(
    consumer: ConsumerDeclaration, declaration: PrunerDeclaration, resources: Resources
) -> tuple[Window, str]:
    """The consumer's window and where it came from."""
    if consumer.name in declaration.windows:
        return declaration.windows[consumer.name], "pruner(windows=...)"
    if resources.memory_broker is None:
        try:
            found = broker_retention(consumer, resources)
            return found, f"{consumer.broker}: {found.describe()}"
        except RetentionUnknown as unknown:
            if declaration.retention is None:
                raise ConfigurationError(
                    f"pruner: the window of consumer {consumer.name!r}: {unknown}; give "
                    f"app.pruner(windows={{{consumer.name!r}: timedelta(...)}}) or retention="
                ) from None
    if declaration.retention is None:
        raise ConfigurationError(
            f"pruner: no window for consumer {consumer.name!r}: give app.pruner(retention=...)"
        )
    return declaration.retention, "pruner(retention=...)"


def pruner_config(
    declaration: PrunerDeclaration,
    consumers: Sequence[ConsumerDeclaration],
    resources: Resources,
) -> PrunerConfig:
    windows: dict[str, Any] = {c.name: window_of(c, declaration, resources)[0] for c in consumers}
    names = list(windows) or None
    if not windows:  # no consumer: retention None prunes no consumer's records, the outbox
        return PrunerConfig(None, **declaration.settings)
    return PrunerConfig(None, windows=windows, consumers=names, **declaration.settings)
