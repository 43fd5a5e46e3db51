"""App: a service's consumers, and optionally its relay and pruner, declared in one module.

A thin registry over the runners: each declaration is checked when it is made (a
ConfigurationError naming the thing and the fix), and ``build()`` turns them into
RunningParts (a fresh runner at each ``run()``) that ``consumerdedup run module:app``
or ``App.run()`` runs, each in a thread::

    app = App("payments")

    @app.rabbitmq(queue="payments", consumer="payments", batch_size=50)
    def handle(payment: Payment, session: Session) -> None: ...

    app.relay(to="kafka")
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from sqlalchemy import Engine

from .. import options
from ..errors import ConfigurationError
from ..schema import DEFAULT, Tables
from ..startup import Check
from . import running
from .admin_page import AdminDeclaration, declare_admin
from .declarations import (
    KAFKA,
    RABBITMQ,
    ConsumerDeclaration,
    PrunerDeclaration,
    RelayDeclaration,
    declare_consumer,
    declare_pruner,
    declare_relay,
)
from .parts import ConsumerPart, Part, PrunerPart, RelayPart
from .resources import Resources
from .settings import Settings, database_url_problem
from .typed_bodies import check_body_model

if TYPE_CHECKING:
    from ..testing import MemoryBroker

F = TypeVar("F")


class App:
    """A service's parts by name: consumers (``kafka``, ``rabbitmq``, ``consumer``), and
    at most one ``relay`` and one ``pruner``. ``database_url`` or ``engine`` given here
    beat ``CONSUMERDEDUP_DATABASE_URL``."""

    def __init__(
        self,
        name: str,
        *,
        database_url: str | None = None,
        engine: Engine | None = None,
        tables: Tables = DEFAULT,
    ) -> None:
        self.name = options.text(name, "App(name)")
        self.database_url = options.maybe(
            database_url, "App(database_url)", options.text, secret=True
        )
        if self.database_url is not None and (problem := database_url_problem(self.database_url)):
            raise ConfigurationError(
                "App(database_url): expected a SQLAlchemy database URL, got a value not shown "
                f"(str): {problem}"
            )
        if engine is not None:
            options.instance(engine, "App(engine)", Engine, "a sqlalchemy Engine")
        self.engine = engine
        self.tables = options.instance(tables, "App(tables)", Tables, "a Tables")
        self.consumers: dict[str, ConsumerDeclaration] = {}
        self.relay_declaration: RelayDeclaration | None = None
        self.pruner_declaration: PrunerDeclaration | None = None
        self.admin_declaration: AdminDeclaration | None = None
        self._running: list[Part] = []
        self._stop_asked = False

    # --- declaring -------------------------------------------------------------------

    def consumer(
        self,
        fn: object = None,
        /,
        *,
        consumer: str | None = None,
        topics: str | Sequence[str] | None = None,
        queue: str | None = None,
        bulk: bool = False,
        **given: Any,
    ) -> Callable[[F], F]:
        """A handler of Kafka ``topics`` or of a RabbitMQ ``queue`` (one of them), its
        consumer name (its dedup records' and its part's name), per message or ``bulk``;
        the other keywords go to the runner's config and the Deduplicator."""
        consumer = _named(fn, consumer, "consumer", "topics=[...] or queue='...'")
        if (topics is None) == (queue is None):
            what = "both topics and queue" if topics is not None else "no source"
            raise ConfigurationError(
                f"consumer {consumer!r} has {what}: give topics=[...] (Kafka) or "
                "queue='...' (RabbitMQ), one of them"
            )
        if topics is not None:
            return self.kafka(topics=topics, consumer=consumer, bulk=bulk, **given)
        assert queue is not None
        return self.rabbitmq(queue=queue, consumer=consumer, bulk=bulk, **given)

    def kafka(
        self,
        fn: object = None,
        /,
        *,
        topics: str | Sequence[str] | None = None,
        consumer: str | None = None,
        bulk: bool = False,
        **given: Any,
    ) -> Callable[[F], F]:
        """A handler of one Kafka topic or several (options: KafkaConfig's, ``group_id``)."""
        consumer = _named(fn, consumer, "kafka", "topics=[...]")
        if topics is None:
            raise ConfigurationError(f"consumer {consumer!r} has no source: give topics=[...]")
        sources = options.names(topics, f"consumer {consumer!r} topics")
        return self._declaring(KAFKA, consumer, sources, bulk, given)

    def rabbitmq(
        self,
        fn: object = None,
        /,
        *,
        queue: str | None = None,
        consumer: str | None = None,
        bulk: bool = False,
        **given: Any,
    ) -> Callable[[F], F]:
        """A handler of a RabbitMQ queue (options: RabbitConfig's)."""
        consumer = _named(fn, consumer, "rabbitmq", "queue='...'")
        if queue is None:
            raise ConfigurationError(f"consumer {consumer!r} has no source: give queue='...'")
        source = options.text(queue, f"consumer {consumer!r} queue", max_length=255)
        return self._declaring(RABBITMQ, consumer, (source,), bulk, given)

    def _declaring(
        self, broker: str, consumer: object, sources: tuple[str, ...], bulk: object, given: Any
    ) -> Callable[[F], F]:
        name = options.text(consumer, "consumer", max_length=255)
        self._name_free(name, "consumer")

        def decorate(fn: F) -> F:
            self._name_free(name, "consumer")  # two decorators made before either applied
            declared = declare_consumer(
                fn, broker=broker, consumer=name, sources=sources, bulk=bulk, given=dict(given)
            )
            self._source_free(declared)
            self.consumers[name] = declared
            return fn

        return decorate

    def relay(self, *, to: str, name: str = "relay", **given: Any) -> None:
        """The outbox relay to ``"kafka"`` or ``"rabbitmq"`` (options: RelayConfig's, and
        ``publisher_options`` for the publisher's constructor)."""
        if self.relay_declaration is not None:
            raise ConfigurationError(
                f"the app has a relay already ({self.relay_declaration.name!r})"
            )
        declared = declare_relay(name, to, dict(given))
        self._name_free(declared.name, "relay")
        self.relay_declaration = declared

    def pruner(
        self,
        *,
        every: timedelta,
        name: str = "pruner",
        retention: timedelta | None = None,
        windows: dict[str, timedelta | None] | None = None,
        **given: Any,
    ) -> None:
        """A prune round every ``every`` over the app's consumers: each by its window in
        ``windows``, else the one its broker reports, else ``retention``."""
        if self.pruner_declaration is not None:
            raise ConfigurationError(
                f"the app has a pruner already ({self.pruner_declaration.name!r})"
            )
        declared = declare_pruner(name, every, retention, windows, dict(given))
        self._name_free(declared.name, "pruner")
        self.pruner_declaration = declared

    def admin(
        self,
        *,
        authorize: Callable[..., Any] | None = None,
        token: str | None = None,
        allow_loopback: bool = False,
        actions: bool = False,
        replay: Callable[..., Any] | None = None,
        audit: Callable[..., Any] | Literal["table"] | None = None,
        show_bodies: bool = False,
        port: int | None = None,
    ) -> None:
        """The admin pages (``admin_app``'s options) that ``consumerdedup run``'s supervisor
        serves on ``CONSUMERDEDUP_ADMIN_PORT`` (or ``--admin-port``, else ``port``); not a
        part: no worker child serves them. Who may see them is required: ``authorize``, a
        token (``token`` or ``CONSUMERDEDUP_ADMIN_TOKEN``) or ``allow_loopback=True``."""
        if self.admin_declaration is not None:
            raise ConfigurationError(f"app {self.name!r} declares its admin pages already")
        self.admin_declaration = declare_admin(
            authorize=authorize, token=token, allow_loopback=allow_loopback, actions=actions,
            replay=replay, audit=audit, show_bodies=show_bodies, port=port,
        )  # fmt: skip

    def _name_free(self, name: str, what: str) -> None:
        taken = {
            n: f"consumer {n!r} ({_handler_name(d.handler)})" for n, d in self.consumers.items()
        }
        for part in (self.relay_declaration, self.pruner_declaration):
            if part is not None:
                taken[part.name] = f"the {type(part).__name__.removesuffix('Declaration').lower()}"
        if name in taken:
            raise ConfigurationError(
                f"two parts named {name!r}: {taken[name]} and this {what}; give each its own "
                "name (a consumer's name is its dedup records' name: keep it once chosen)"
            )

    def _source_free(self, declared: ConsumerDeclaration) -> None:
        """No two consumers of one queue, nor of one topic in one Kafka group: they would
        share its messages under two names, so a redelivery (a crash between COMMIT and the
        ack, a rebalance) reaching the other one finds no record and is applied again."""
        for other in self.consumers.values():
            if other.broker != declared.broker:
                continue
            shared = sorted(set(other.sources) & set(declared.sources))
            if not shared:
                continue
            if declared.broker == RABBITMQ:
                raise ConfigurationError(
                    f"consumers {other.name!r} and {declared.name!r} both consume queue "
                    f"{shared[0]!r}: RabbitMQ would share its messages between them, and a "
                    "redelivery that reaches the other one is applied again (its records are "
                    "kept under the other name); give the queue one consumer, or each "
                    "consumer a queue of its own"
                )
            group = declared.group_id or declared.name
            if (other.group_id or other.name) == group:
                raise ConfigurationError(
                    f"consumers {other.name!r} and {declared.name!r} both consume topic "
                    f"{shared[0]!r} in Kafka group {group!r}: the group would share its "
                    "partitions between them, and a record re-read after a rebalance by the "
                    "other one is applied again (its records are kept under the other name); "
                    "give each consumer a group of its own (group_id), or one consumer the "
                    "topic"
                )

    def _check_windows(self) -> None:
        """Every consumer the pruner's ``windows`` names is one of the app's (checked once
        every declaration is made: the pruner may come before its consumers). A misspelt
        name was ignored, and its consumer pruned by its broker's window or ``retention``
        instead of the longer one given for it: records pruned while a redelivery can come."""
        pruner = self.pruner_declaration
        if pruner is None:
            return
        if unknown := sorted(set(pruner.windows) - set(self.consumers)):
            raise ConfigurationError(
                f"pruner(windows=...) names {', '.join(map(repr, unknown))}, not a consumer "
                f"of app {self.name!r} (its consumers: {', '.join(self.consumers) or 'none'}): "
                "name each consumer as declared"
            )

    # --- running ---------------------------------------------------------------------

    @property
    def part_names(self) -> list[str]:
        names = list(self.consumers)
        names += [d.name for d in (self.relay_declaration, self.pruner_declaration) if d]
        return names

    def _selected(self, only: Collection[str] | None) -> set[str]:
        if only is None:
            return set(self.part_names)
        chosen = set(options.names(only, "only"))
        if unknown := sorted(chosen - set(self.part_names)):
            raise ConfigurationError(
                f"no part named {', '.join(map(repr, unknown))} in app {self.name!r} "
                f"(its parts: {', '.join(self.part_names) or 'none'})"
            )
        return chosen

    def resources(
        self, settings: Settings | None = None, *, memory_broker: MemoryBroker | None = None
    ) -> Resources:
        return Resources(
            settings or Settings.load(),
            self.tables,
            database_url=self.database_url,
            engine=self.engine,
            memory_broker=memory_broker,
        )

    def build(
        self,
        settings: Settings | None = None,
        only: Collection[str] | None = None,
        *,
        memory_broker: MemoryBroker | None = None,
    ) -> list[Part]:
        """The parts to run (``only``: those named), over the databases and brokers of
        ``settings`` (default: ``Settings.load()``), or all consumers and the relay on
        ``memory_broker`` (each topic or queue a queue of it) for tests."""
        chosen = self._selected(only)
        self._check_windows()
        shared = self.resources(settings, memory_broker=memory_broker)
        parts: list[Part] = [
            ConsumerPart(d, shared) for n, d in self.consumers.items() if n in chosen
        ]
        if (relay := self.relay_declaration) and relay.name in chosen:
            parts.append(RelayPart(relay, shared))
        if (pruner := self.pruner_declaration) and pruner.name in chosen:
            parts.append(PrunerPart(pruner, shared, list(self.consumers.values())))
        return parts

    def check(
        self, settings: Settings | None = None, only: Collection[str] | None = None
    ) -> list[Check]:
        """The start checks and the doctor's checks for exactly what the app declares."""
        from .checks import app_checks

        self._check_windows()
        chosen = self._selected(only)
        for name, declaration in self.consumers.items():
            if name in chosen and not declaration.wrapped:
                check_body_model(declaration.handler)
        return app_checks(self, self.resources(settings), chosen)

    def run(
        self,
        only: Collection[str] | None = None,
        settings: Settings | None = None,
        *,
        memory_broker: MemoryBroker | None = None,
        until_idle: bool = False,
    ) -> None:
        """Run the parts in this process, each in a thread, until ``stop()`` (or SIGTERM /
        SIGINT when called on the main thread); a part's error stops the others and is
        raised. ``until_idle``: rounds of every part until one does nothing (tests)."""
        self._stop_asked = False  # a stop() before this run is not this run's
        self._run(only, settings, memory_broker, until_idle)

    def _run(
        self,
        only: Collection[str] | None,
        settings: Settings | None,
        memory_broker: MemoryBroker | None,
        until_idle: bool,
    ) -> None:
        parts = self.build(settings, only, memory_broker=memory_broker)
        self._running = parts
        # A stop() that came while they were being built found no parts to stop: it was
        # lost (the flag was reset here), and a run_async() cancelled at its start waited
        # for ever. Stopped now, each runner stops as soon as it is made.
        if self._stop_asked:
            for part in parts:
                part.stop()
        try:
            if until_idle:
                running.until_idle(parts)
            else:
                with running.stop_on_signals(self.stop):
                    running.in_threads(parts)
        finally:
            self._running = []
            if parts:
                parts[0].resources.close()  # type: ignore[attr-defined]

    async def run_async(
        self,
        only: Collection[str] | None = None,
        settings: Settings | None = None,
        *,
        memory_broker: MemoryBroker | None = None,
        until_idle: bool = False,
    ) -> None:
        """``run()`` from asyncio code (in a thread); cancelling it stops the parts."""
        self._stop_asked = False  # here, not in the thread: a cancel before it starts counts
        running = asyncio.ensure_future(
            asyncio.to_thread(self._run, only, settings, memory_broker, until_idle)
        )
        try:
            await asyncio.shield(running)
        except asyncio.CancelledError:
            self.stop()
            await running
            raise

    def stop(self, deadline: float | None = None) -> None:
        """Stop what ``run()`` runs (takes no lock: a signal handler may call it)."""
        self._stop_asked = True
        for part in self._running:
            part.stop(deadline)

    def __repr__(self) -> str:
        return f"<App {self.name!r}: {', '.join(self.part_names) or 'no parts'}>"


def _named(fn: object, consumer: str | None, decorator: str, source: str) -> str:
    """The consumer's name; a decorator used bare, or without a name, said with the fix."""
    if fn is not None:
        raise ConfigurationError(
            f"@app.{decorator} on {getattr(fn, '__name__', fn)!r} without its arguments: "
            f"write @app.{decorator}(consumer='name', {source})"
        )
    if consumer is None:
        raise ConfigurationError(
            f"@app.{decorator}(...) needs consumer='name': the name its dedup records are "
            "kept under (keep it once chosen: a new name forgets what was processed)"
        )
    return consumer


def _handler_name(handler: Any) -> str:
    fn = getattr(handler, "fn", handler)
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
