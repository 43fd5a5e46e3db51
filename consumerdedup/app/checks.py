"""``App.check()``: the start checks and the doctor's checks for exactly what an app
declares, as data (``startup.Check`` lines) for ``consumerdedup run --check`` to print.

- the database: reachable, the tables the chosen parts use, their keys, the rights;
- each consumer: its topics or queue, and its dead-letter topics or queue (declared at
  start when ``declare=True``, so not required then);
- the relay: its broker answers;
- the pruner: each consumer's window (its own, its broker's, or the common one), and a
  window given shorter than what its broker reports (a redelivery could find no record).

Nothing is consumed, published or changed. A broker that cannot be asked is a FAIL
line, not an exception.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError
from ..prune.windows import BrokerRetention, RetentionUnknown
from ..reasons import describe
from ..startup import FAIL, OK, WARN, Check, startup_checks
from .declarations import KAFKA, ConsumerDeclaration
from .resources import Resources
from .windows import broker_retention, off_the_loop, window_of

if TYPE_CHECKING:
    from .app import App

_BROKER_FIX = "check the broker's address and credentials, and that it runs"


def app_checks(app: App, resources: Resources, chosen: set[str]) -> list[Check]:
    consumers = [d for n, d in app.consumers.items() if n in chosen]
    relay, pruner = app.relay_declaration, app.pruner_declaration
    relay = relay if relay is not None and relay.name in chosen else None
    pruner = pruner if pruner is not None and pruner.name in chosen else None
    # A Kafka consumer keeping its offsets in the database needs consumer_offsets too.
    offsets = any(
        c.broker == KAFKA and getattr(c.config, "offsets", "broker") == "database"
        for c in consumers
    )
    found = _database(resources, bool(consumers or pruner), bool(relay or pruner), offsets)
    for consumer in consumers:
        found.append(_sources(consumer, resources))
    if relay is not None:
        found.append(_relay_broker(relay.name, relay.to, resources))
    if pruner is not None:
        for consumer in app.consumers.values():
            found.append(_window(consumer, pruner, resources))
    return found


def _database(
    resources: Resources, events: bool, outbox: bool, offsets: bool = False
) -> list[Check]:
    tables = resources.tables
    needed = [t for t, used in ((tables.processed_events, events), (tables.outbox, outbox)) if used]
    if offsets and tables.consumer_offsets is not None:
        needed.append(tables.consumer_offsets)
    try:
        engine = resources.engine()
    except ConfigurationError as error:
        return [Check("database", FAIL, str(error), "set CONSUMERDEDUP_DATABASE_URL")]
    return startup_checks(engine, tables, needed)


def _sources(consumer: ConsumerDeclaration, resources: Resources) -> Check:
    name = f"consumer {consumer.name}"
    dead = [consumer.config.dead_letters_of(source) for source in consumer.sources]
    wanted = [*consumer.sources, *dead]
    try:
        if consumer.broker == KAFKA:
            missing = _missing_topics(consumer, resources, wanted)
            what = "topic"
            fix = "create them (the runner does not), or fix the names"
        else:
            if consumer.config.declare:
                return Check(name, OK, f"queue {', '.join(wanted)}: declared at start")
            missing = _missing_queues(consumer, resources, wanted)
            what = "queue"
            fix = "declare them, or set declare=True on the consumer"
    except ConfigurationError as error:
        return Check(name, FAIL, str(error), "set the broker's address")
    except Exception as error:
        return Check(name, FAIL, f"cannot ask the broker: {describe(error)}", _BROKER_FIX)
    if missing:
        return Check(name, FAIL, f"missing {what}(s): {', '.join(missing)}", fix)
    return Check(name, OK, f"{what}s {', '.join(wanted)} exist")


def _missing_topics(
    consumer: ConsumerDeclaration, resources: Resources, topics: list[str]
) -> list[str]:
    if resources.memory_broker is not None:
        return []
    kafka = importlib.import_module("consumerdedup.adapters.kafka.topology")
    found: list[str] = off_the_loop(
        kafka.missing_topics, resources.kafka_bootstrap(), topics, client_options=_client(consumer)
    )
    return found


def _missing_queues(
    consumer: ConsumerDeclaration, resources: Resources, queues: list[str]
) -> list[str]:
    if resources.memory_broker is not None:
        return []
    rabbit = importlib.import_module("consumerdedup.adapters.rabbitmq.topology")
    found: list[str] = rabbit.missing_queues(
        queues,
        url=resources.rabbitmq_url(),
        connection_options=consumer.config.connection_options,
    )
    return found


def _client(consumer: ConsumerDeclaration) -> dict[str, Any]:
    """The consumer's security options, which an admin client takes too."""
    options = dict(consumer.config.consumer_options)
    return {k: v for k, v in options.items() if k.startswith(("security", "sasl", "ssl"))}


def _relay_broker(name: str, to: str, resources: Resources) -> Check:
    label = f"relay {name}"
    try:
        if resources.memory_broker is not None:
            pass
        elif to == KAFKA:
            kafka = importlib.import_module("consumerdedup.adapters.kafka.topology")
            kafka.missing_topics(resources.kafka_bootstrap(), [])
        else:
            rabbit = importlib.import_module("consumerdedup.adapters.rabbitmq.topology")
            rabbit.missing_queues([], url=resources.rabbitmq_url())
    except ConfigurationError as error:
        return Check(label, FAIL, str(error), "set the broker's address")
    except Exception as error:
        return Check(label, FAIL, f"cannot reach {to}: {describe(error)}", _BROKER_FIX)
    return Check(label, OK, f"{to} answers")


def _window(consumer: ConsumerDeclaration, pruner: Any, resources: Resources) -> Check:
    label = f"window {consumer.name}"
    try:
        window, source = window_of(consumer, pruner, resources)
    except ConfigurationError as error:
        return Check(label, FAIL, str(error), "give the window explicitly")
    except Exception as error:
        said = f"cannot read the broker's retention: {describe(error)}"
        return Check(label, FAIL, said, _BROKER_FIX)
    if consumer.name in pruner.windows and resources.memory_broker is None:
        return _against_broker(label, consumer, window, resources)
    if isinstance(window, BrokerRetention):
        return Check(label, OK, f"{_render(window.window)} ({source})")
    return Check(label, OK, f"{_render(window)} ({source})")


def _against_broker(
    label: str, consumer: ConsumerDeclaration, window: Any, resources: Resources
) -> Check:
    """A window given explicitly, beside what the broker says (if it says)."""
    try:
        broker = broker_retention(consumer, resources)
    except RetentionUnknown:
        return Check(label, WARN, f"{_render(window)} given; the broker does not say its own")
    except Exception as error:
        return Check(label, WARN, f"{_render(window)} given; broker not asked: {describe(error)}")
    if broker.window is not None and (window is not None and window < broker.window):
        return Check(
            label,
            FAIL,
            f"{_render(window)} given, but {broker.describe()}: a redelivery could find its "
            "record pruned",
            f"give at least {_render(broker.window)}, or leave the window to the broker",
        )
    return Check(label, OK, f"{_render(window)} given; the broker: {broker.describe()}")


def _render(window: Any) -> str:
    from .. import durations

    return "forever" if window is None else durations.render(window)
