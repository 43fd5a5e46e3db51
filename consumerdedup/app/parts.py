"""The running parts of an App: each a RunningPart over a runner, the relay or the pruner.

A part makes a fresh runner at each ``run()`` (so a host may run it again after an
outage) and forwards ``stop()``, ``ready`` and ``last_tick`` to it. ``stop()`` takes no
lock (a host calls it from its signal handler): it sets a flag and stops the runner
running now; a runner made after it is stopped as soon as it is made.
"""

from __future__ import annotations

import asyncio
import importlib
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol

from .. import options
from ..outbox.relay import OutboxRelay
from ..prune.pruner import Pruner
from .declarations import KAFKA, ConsumerDeclaration, PrunerDeclaration, RelayDeclaration
from .resources import Resources
from .windows import pruner_config


class Switch(Protocol):
    """What a part forwards to: a runner, the relay, the pruner (a StopSwitch each)."""

    def stop(self, deadline: float | None = None) -> None: ...

    @property
    def ready(self) -> bool: ...

    @property
    def last_tick(self) -> float: ...


class Part:
    """The lifecycle a host sees, over whatever runs now."""

    kind = "part"

    def __init__(self, name: str) -> None:
        self.name = name
        self._stop_asked = False
        self._deadline_at: float | None = None
        self._current: Sequence[Switch] = ()
        self._born = time.monotonic()
        self.handled = 0
        """Messages decided (a consumer) or events published (the relay) by its runs."""

    def stop(self, deadline: float | None = None) -> None:
        """Ask the part to stop (see lifecycle.StopSwitch.stop); takes no lock."""
        if deadline is not None:
            seconds = options.number(deadline, "stop(deadline) in seconds", at_least=0)
            self._deadline_at = time.monotonic() + seconds
        self._stop_asked = True
        for switch in self._current:
            switch.stop(self._left())

    @property
    def stopping(self) -> bool:
        return self._stop_asked

    def _left(self) -> float | None:
        at = self._deadline_at
        return None if at is None else max(at - time.monotonic(), 0.0)

    def _attach(self, switches: Sequence[Switch]) -> None:
        self._current = switches
        if self._stop_asked:  # stop() came while they were being made
            for switch in switches:
                switch.stop(self._left())

    @property
    def ready(self) -> bool:
        current = self._current
        return bool(current) and all(s.ready for s in current) and not self._stop_asked

    @property
    def last_tick(self) -> float:
        current = self._current
        return min((s.last_tick for s in current), default=self._born)

    @property
    def waiting_for(self) -> str | None:
        """The outage a runner's start checks wait out (lifecycle.StopSwitch), if any."""
        return next((w for s in self._current if (w := getattr(s, "waiting_for", None))), None)

    def __repr__(self) -> str:
        return f"<{self.kind} {self.name!r}>"


class ConsumerPart(Part):
    """A consumer's runner: Kafka, RabbitMQ, or the memory broker's (one per source)."""

    kind = "consumer"

    def __init__(self, declaration: ConsumerDeclaration, resources: Resources) -> None:
        super().__init__(declaration.name)
        self.declaration = declaration
        self.resources = resources
        self.handler = resources.handler(declaration)

    def run(self, *, until_idle: bool = False) -> None:
        """Consume until stopped (``until_idle``: until the source is drained)."""
        if self.resources.memory_broker is None and self.declaration.broker == KAFKA:
            asyncio.run(self.run_async(until_idle=until_idle))
            return
        runners = self._runners()
        self._attach(runners)
        try:
            if len(runners) == 1:
                runners[0].run(until_idle=until_idle)
            else:
                _all_in_threads(runners, until_idle)
        finally:
            self.handled += sum(sum(r.outcomes.values()) for r in runners)

    async def run_async(self, *, until_idle: bool = False) -> None:
        """The Kafka runner on the running event loop (its handler's engine may be bound to it)."""
        runner = self._runners()[0]
        self._attach([runner])
        try:
            await runner.run(until_idle=until_idle)
        finally:
            self.handled += sum(runner.outcomes.values())

    def _runners(self) -> list[Any]:
        d, broker = self.declaration, self.resources.memory_broker
        if broker is not None:
            from ..testing import MemoryConfig, MemoryConsumerRunner

            config = MemoryConfig(
                batch_size=d.config.batch_size,
                poll_timeout=timedelta(milliseconds=100),
                retry_delay=d.config.retry_delay,
                max_retry_delay=d.config.max_retry_delay,
            )
            return [
                MemoryConsumerRunner(
                    self.handler, source, broker=broker, config=config, before_ack=d.before_ack
                )
                for source in d.sources
            ]
        if d.broker == KAFKA:
            kafka = importlib.import_module("consumerdedup.adapters.kafka")
            return [
                kafka.KafkaConsumerRunner(
                    self.handler,
                    d.sources,
                    bootstrap_servers=self.resources.kafka_bootstrap(),
                    group_id=d.group_id,
                    config=d.config,
                    before_ack=d.before_ack,
                )
            ]
        rabbit = importlib.import_module("consumerdedup.adapters.rabbitmq")
        return [
            rabbit.RabbitConsumerRunner(
                self.handler,
                d.sources[0],
                url=self.resources.rabbitmq_url(),
                config=d.config,
                before_ack=d.before_ack,
            )
        ]


class RelayPart(Part):
    """The outbox relay, to the declared broker (or the memory broker)."""

    kind = "relay"

    def __init__(self, declaration: RelayDeclaration, resources: Resources) -> None:
        super().__init__(declaration.name)
        self.declaration = declaration
        self.resources = resources

    def relay(self) -> OutboxRelay:
        d = self.declaration
        publisher = self.resources.publisher(d.to, d.publisher_options)
        return OutboxRelay(
            self.resources.engine(), publisher, tables=self.resources.tables, config=d.config
        )

    def run(self, *, until_idle: bool = False) -> None:
        relay = self.relay()
        self._attach([relay])
        try:
            if until_idle:
                with relay:
                    relay.drain()
                return
            relay.run()
        finally:
            self.handled += relay.published


class PrunerPart(Part):
    """The pruner, a round every ``every``, over the app's consumers' windows."""

    kind = "pruner"

    def __init__(
        self,
        declaration: PrunerDeclaration,
        resources: Resources,
        consumers: Sequence[ConsumerDeclaration],
    ) -> None:
        super().__init__(declaration.name)
        self.declaration = declaration
        self.resources = resources
        self.consumers = consumers

    def pruner(self) -> Pruner:
        config = pruner_config(self.declaration, self.consumers, self.resources)
        return Pruner(self.resources.engine(), config=config, tables=self.resources.tables)

    def run(self, *, until_idle: bool = False) -> None:
        pruner = self.pruner()
        self._attach([pruner])
        if until_idle:
            pruner.run_once()
            return
        pruner.run(self.declaration.every)


def _all_in_threads(runners: Sequence[Any], until_idle: bool) -> None:
    """Run each runner in a thread; wait for all; the first error stops the others and is
    raised."""
    errors: list[BaseException] = []

    def run(runner: Any) -> None:
        try:
            runner.run(until_idle=until_idle)
        except BaseException as error:
            errors.append(error)
            for other in runners:
                other.stop()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in runners]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
