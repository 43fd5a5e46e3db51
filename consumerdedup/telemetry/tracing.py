"""Spans and metrics for one event's trip: ``Outbox.add`` -> ``send`` -> ``process``.

* ``Outbox.add`` writes the current W3C trace context (traceparent, tracestate,
  baggage) into the new event's headers, with the row, in the caller's transaction.
* The relay's ``send <destination>`` PRODUCER span has that stored context as its
  parent and a link to the relay's own ``send`` CLIENT span of the window (a trace of
  the relay's); the message goes out with the send span's context in its headers.
* The consumer's ``process <destination>`` CONSUMER span is a child of the producer's
  context for a single message; a batch's span links to every message's context, and
  each message gets its own span under it, linked to its producer. While the handler
  runs, the process span is current: a second ``Outbox.add`` continues the trace.
* A RETRY's next delivery links to the span that ended RETRY (not an orphan).

Errors are recorded as ``error.type`` and an ``exception`` event whose message and
stack trace are scrubbed like a reason (never a bound parameter).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, propagate, trace
from opentelemetry.trace import Link, SpanKind

from ..headers import ID_HEADER
from ..message import Message
from ..outcome import Outcome, Result
from .attributes import consumer_attributes, producer_attributes, publisher_system, system_of
from .events import TRACE_HEADERS, record_error
from .metrics import Instruments

RETRIES_REMEMBERED = 10_000
"""Span contexts of RETRY outcomes kept for the next delivery's link (oldest dropped)."""


def _delivery(delivered: Any) -> Message:
    message: Message = delivered[0] if isinstance(delivered, tuple) else delivered
    return message


class _Idle:
    """The token of a batch while no SDK is set up: nothing to record, nothing to end."""

    def finish(self, results: Sequence[Result]) -> None:
        pass

    def fail(self, error: BaseException) -> None:
        pass


IDLE = _Idle()


class Tracing:
    """The hooks over a tracer and the instruments.

    ``idle``: the global providers as they were at ``instrument()`` when it was given
    none and the application had set none (OpenTelemetry's proxies). While they are
    still the globals no SDK is set up: the hooks do nothing (two reads per batch).
    """

    def __init__(
        self, tracer: trace.Tracer, instruments: Instruments, idle: tuple[object, object] | None
    ) -> None:
        self.tracer = tracer
        self.instruments = instruments
        self.idle = idle
        self._retried: OrderedDict[tuple[str, str], trace.SpanContext] = OrderedDict()
        self._retried_lock = threading.Lock()  # runners of several threads share it

    def live(self) -> bool:
        """Whether an SDK is set up (once it is, it stays)."""
        idle = self.idle
        if idle is None:
            return True
        if trace.get_tracer_provider() is idle[0] and metrics.get_meter_provider() is idle[1]:
            return False
        self.idle = None
        return True

    # consumer side

    def start(self, consumer: str, deliveries: Sequence[Any]) -> ProcessSpans | _Idle:
        if not self.live():
            return IDLE
        messages = [_delivery(d) for d in deliveries]
        return ProcessSpans(self, consumer, messages)

    def links_for(self, consumer: str, message: Message) -> tuple[Any, list[Link]]:
        """The producer's context from the message's headers (None: it carries none),
        and the links: to that producer, then to the RETRY'd attempt, if any."""
        links = []
        producer = None
        if message.headers:
            parent = propagate.extract(message.headers)
            found = trace.get_current_span(parent).get_span_context()
            if found.is_valid:
                producer = parent
                links.append(Link(found))
        earlier = self._retried.get((consumer, str(message.id))) if self._retried else None
        if earlier is not None:
            links.append(Link(earlier, {"consumerdedup.link": "retry"}))
        return producer, links

    def remember_retry(self, consumer: str, message: Message, span: Any) -> None:
        with self._retried_lock:
            self._retried[(consumer, str(message.id))] = span.get_span_context()
            self._retried.move_to_end((consumer, str(message.id)))
            while len(self._retried) > RETRIES_REMEMBERED:
                self._retried.popitem(last=False)

    def forget_retry(self, consumer: str, message: Message) -> None:
        if self._retried:
            with self._retried_lock:
                self._retried.pop((consumer, str(message.id)), None)

    # relay side

    def send(self, publisher: object, messages: Sequence[Any], publish: Any) -> list[Any]:
        """The relay's hook: a PRODUCER span per message around the window's publish."""
        if not self.live():
            return list(publish(messages))
        system = publisher_system(publisher)
        # The relay's own round: a CLIENT span of its trace that every send links to.
        window = self.tracer.start_span(
            "send", None, SpanKind.CLIENT,
            {"messaging.system": system, "messaging.operation.name": "send",
             "messaging.operation.type": "send", "messaging.batch.message_count": len(messages)},
        )  # fmt: skip
        relay_link = window.get_span_context()
        spans, outgoing = [], []
        started = time.perf_counter()
        for message in messages:
            parent = propagate.extract(dict(message.headers))
            links = [Link(relay_link)] if relay_link.is_valid else []
            attributes = producer_attributes(
                system, message.destination, message.headers.get(ID_HEADER)
            )
            span = self.tracer.start_span(
                f"send {message.destination}", parent, SpanKind.PRODUCER, attributes, links
            )
            headers = {k: v for k, v in message.headers.items() if k not in TRACE_HEADERS}
            propagate.inject(headers, context=trace.set_span_in_context(span, parent))
            spans.append(span)
            outgoing.append(message._replace(headers=headers))
        try:
            outcomes: list[Any] = publish(outgoing)
        except BaseException as exc:
            outcomes = [exc] * len(spans)
            raise
        finally:
            seconds = time.perf_counter() - started
            for span, message, outcome in zip(spans, outgoing, outcomes, strict=False):
                if isinstance(outcome, BaseException):
                    record_error(span, outcome)
                span.end()
                self.instruments.sent(system, message.destination, outcome, seconds)
            window.end()
        return outcomes


class ProcessSpans:
    """One batch's process spans, from its start to its Results."""

    def __init__(self, tracing: Tracing, consumer: str, messages: list[Message]) -> None:
        self.tracing, self.consumer, self.messages = tracing, consumer, messages
        self.started = time.perf_counter()
        tracer, first = tracing.tracer, messages[0] if messages else Message(None, b"")
        name = f"process {first.source or '(unknown)'}"
        attributes = consumer_attributes(first, consumer)
        self.children: list[Any] = []
        if len(messages) == 1:  # a child of its producer, linked to its RETRY'd attempt
            parent, links = tracing.links_for(consumer, first)
            links = links[1:] if parent is not None else links
            self.span = tracer.start_span(name, parent, SpanKind.CONSUMER, attributes, links)
        else:
            for key in ("messaging.message.id", "messaging.kafka.offset"):
                attributes.pop(key, None)
            attributes.pop("messaging.rabbitmq.message.delivery_tag", None)
            attributes["messaging.batch.message_count"] = len(messages)
            links = [link for m in messages for link in tracing.links_for(consumer, m)[1]]
            self.span = tracer.start_span(name, None, SpanKind.CONSUMER, attributes, links)
            batch = trace.set_span_in_context(self.span)
            for message in messages:
                self.children.append(
                    tracer.start_span(
                        f"process {message.source or '(unknown)'}", batch, SpanKind.CONSUMER,
                        consumer_attributes(message, consumer),
                        tracing.links_for(consumer, message)[1],
                    )
                )  # fmt: skip
        self._token = otel_context.attach(trace.set_span_in_context(self.span))

    def finish(self, results: Sequence[Result]) -> None:
        otel_context.detach(self._token)
        seconds = time.perf_counter() - self.started
        spans = self.children or [self.span]
        for span, result in zip(spans, results, strict=False):
            self._settle(span, result)
        if self.children:
            outcomes = {r.outcome for r in results}
            self.span.set_attribute(
                "consumerdedup.outcome", outcomes.pop().value if len(outcomes) == 1 else "mixed"
            )
            for span in self.children:
                span.end()
        self.span.end()
        first = self.messages[0] if self.messages else Message(None, b"")
        self.tracing.instruments.processed(
            system_of(first), first.source, self.consumer, results, seconds
        )

    def fail(self, error: BaseException) -> None:
        """The runner's call raised (a setup fault): every span ends with the error."""
        otel_context.detach(self._token)
        for span in [*self.children, self.span]:
            record_error(span, error)
            span.end()

    def _settle(self, span: Any, result: Result) -> None:
        span.set_attribute("consumerdedup.outcome", result.outcome.value)
        if result.error is not None and result.outcome in (Outcome.FAILED, Outcome.RETRY):
            record_error(span, result.error)
        if result.outcome is Outcome.RETRY:
            self.tracing.remember_retry(self.consumer, result.message, span)
        else:
            self.tracing.forget_retry(self.consumer, result.message)
