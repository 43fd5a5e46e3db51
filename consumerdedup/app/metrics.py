"""A worker child's counters, in prometheus_client's multiprocess mode.

Each child counts into files of the run's own directory (``PROMETHEUS_MULTIPROC_DIR``,
set by the supervisor before the child starts), and the supervisor's ``/metrics``
adds them up across children, restarted ones included. The counts come through
the telemetry hooks every runner and relay already call (``telemetry.hooks``): no
part needs metrics code of its own. A hook the application installed first (its
OpenTelemetry ``instrument()``) is kept and called too.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from ..telemetry import hooks
from ..telemetry.prometheus import PREFIX

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class _Instruments:
    def __init__(self) -> None:
        from prometheus_client import Counter as PromCounter
        from prometheus_client import Histogram

        self.messages = PromCounter(
            PREFIX + "messages", "Messages decided, by consumer and outcome",
            ["consumer", "outcome"],
        )  # fmt: skip
        self.batches = Histogram(
            PREFIX + "batch_duration_seconds", "Time a batch took to be decided and committed",
            ["consumer"],
        )  # fmt: skip
        self.batch_errors = PromCounter(
            PREFIX + "batch_errors", "Batches whose processing raised (nothing of them acked)",
            ["consumer"],
        )  # fmt: skip
        self.published = PromCounter(
            PREFIX + "relay_published_events", "Outbox events the relays published (confirmed)"
        )
        self.publish_failures = PromCounter(
            PREFIX + "relay_publish_failures", "Outbox events whose publish failed (retried)"
        )


class _Token:
    __slots__ = ("consumer", "inner", "instruments", "started")

    def __init__(self, instruments: _Instruments, consumer: str, inner: Any) -> None:
        self.instruments, self.consumer, self.inner = instruments, consumer, inner
        self.started = time.perf_counter()

    def finish(self, results: Sequence[Any]) -> None:
        elapsed = time.perf_counter() - self.started
        counts = Counter(result.outcome.value for result in results)
        for outcome, count in counts.items():
            self.instruments.messages.labels(self.consumer, outcome).inc(count)
        self.instruments.batches.labels(self.consumer).observe(elapsed)
        if self.inner is not None:
            self.inner.finish(results)

    def fail(self, error: BaseException) -> None:
        self.instruments.batch_errors.labels(self.consumer).inc()
        if self.inner is not None:
            self.inner.fail(error)


class Counting:
    """The runners' process hook: outcomes and batch times, then the hook it replaced."""

    def __init__(self, instruments: _Instruments, then: hooks.ProcessHook | None) -> None:
        self.instruments, self.then = instruments, then

    def start(self, consumer: str, deliveries: Sequence[Any]) -> _Token:
        inner = self.then.start(consumer, deliveries) if self.then is not None else None
        return _Token(self.instruments, consumer, inner)


def install() -> None:
    """Count from now on in this process (a worker child): chained before any hook set."""
    instruments = _Instruments()
    hooks.process = Counting(instruments, hooks.process)
    previous_send = hooks.send

    def send(publisher: object, messages: Sequence[Any], publish: hooks.SendWindow) -> list[Any]:
        if previous_send is not None:
            outcomes = previous_send(publisher, messages, publish)
        else:
            outcomes = list(publish(messages))
        failed = sum(outcome is not None for outcome in outcomes)
        if len(outcomes) - failed:
            instruments.published.inc(len(outcomes) - failed)
        if failed:
            instruments.publish_failures.inc(failed)
        return outcomes

    hooks.send = send
