"""The OpenTelemetry instruments of the messaging conventions, as consumerdedup feeds them.

* ``messaging.process.duration`` (histogram, s): one record per process operation
  (a message, or a batch), with ``consumerdedup.outcome`` when the batch agrees;
* ``messaging.client.consumed.messages`` (counter): one per message, by outcome;
* ``messaging.client.sent.messages`` (counter) and ``messaging.client.operation.duration``
  (histogram, s, operation ``send``) for the relay;
* ``consumerdedup.http.lease_expired`` (counter): idempotent HTTP requests whose endpoint
  ran past its claim's lease, by ``http.request.method``.
* ``consumerdedup.consumer.breaker.open`` (up-down counter): per consumer, 1 while its
  circuit breaker is open (the runner stopped taking messages), with the ``error.type``
  that opened it; ``consumerdedup.consumer.breaker.trips`` (counter): each opening.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry import metrics

from ..outcome import Result
from .attributes import DURATION_BUCKETS

SCOPE = "consumerdedup"


class Instruments:
    def __init__(self, meter: metrics.Meter) -> None:
        buckets = list(DURATION_BUCKETS)
        self.process_duration = meter.create_histogram(
            "messaging.process.duration",
            unit="s",
            description="Duration of processing operation.",
            explicit_bucket_boundaries_advisory=buckets,
        )
        self.consumed = meter.create_counter(
            "messaging.client.consumed.messages",
            unit="{message}",
            description="Number of messages that were delivered to the application.",
        )
        self.sent_messages = meter.create_counter(
            "messaging.client.sent.messages",
            unit="{message}",
            description="Number of messages producer attempted to send to the broker.",
        )
        self.operation_duration = meter.create_histogram(
            "messaging.client.operation.duration",
            unit="s",
            description="Duration of messaging operation initiated by a producer or consumer.",
            explicit_bucket_boundaries_advisory=buckets,
        )
        self.http_lease_expired = meter.create_counter(
            "consumerdedup.http.lease_expired",
            unit="{request}",
            description="Idempotent HTTP requests whose endpoint ran past its claim's lease "
            "(a twin may have run it again).",
        )

        self.breaker_open = meter.create_up_down_counter(
            "consumerdedup.consumer.breaker.open",
            unit="{breaker}",
            description="1 while the consumer's circuit breaker is open (it takes no messages).",
        )
        self.breaker_trips = meter.create_counter(
            "consumerdedup.consumer.breaker.trips",
            unit="{trip}",
            description="Times the consumer's circuit breaker opened.",
        )

    def breaker(self, consumer: str, error_type: str, opened: bool) -> None:
        """A circuit breaker opened (``opened``) or was reset."""
        attributes = {"consumerdedup.consumer": consumer, "error.type": error_type}
        self.breaker_open.add(1 if opened else -1, attributes)
        if opened:
            self.breaker_trips.add(1, attributes)

    def lease_expired(self, method: str) -> None:
        """An idempotent HTTP request's endpoint ran past its claim's lease."""
        self.http_lease_expired.add(1, {"http.request.method": method})

    def processed(
        self, system: str, destination: str, consumer: str, results: Sequence[Result],
        seconds: float,
    ) -> None:  # fmt: skip
        base: dict[str, Any] = {
            "messaging.system": system,
            "messaging.operation.name": "process",
            "messaging.destination.name": destination,
            "messaging.consumer.group.name": consumer,
        }
        outcomes = {r.outcome.value for r in results}
        timed = dict(base)
        if len(outcomes) == 1:
            timed["consumerdedup.outcome"] = next(iter(outcomes))
        self.process_duration.record(seconds, timed)
        for result in results:
            counted = {**base, "consumerdedup.outcome": result.outcome.value}
            if result.error is not None:
                counted["error.type"] = type(result.error).__qualname__
            self.consumed.add(1, counted)

    def sent(self, system: str, destination: str, outcome: object, seconds: float) -> None:
        attributes: dict[str, Any] = {
            "messaging.system": system,
            "messaging.operation.name": "send",
            "messaging.destination.name": destination,
        }
        if isinstance(outcome, BaseException):
            attributes["error.type"] = type(outcome).__qualname__
        self.sent_messages.add(1, attributes)
        self.operation_duration.record(seconds, attributes)
