"""What a span is told besides its attributes: a scrubbed error, the trace context an
outbox event carries, the HTTP middleware's decision."""

from __future__ import annotations

from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.trace import Status, StatusCode

from ..observe import scrubbed_traceback
from ..reasons import describe

TRACE_HEADERS = ("traceparent", "tracestate", "baggage")
"""The W3C headers an event carries (the propagators' defaults: trace context, baggage)."""


def record_error(span: Any, error: BaseException) -> None:
    """``error.type``, an ERROR status and a scrubbed ``exception`` event on ``span``."""
    span.set_attribute("error.type", type(error).__qualname__)
    span.set_status(Status(StatusCode.ERROR, describe(error)))
    span.add_event(
        "exception",
        {
            "exception.type": type(error).__qualname__,
            "exception.message": describe(error),
            "exception.stacktrace": scrubbed_traceback(error),
        },
    )


def add_trace_context(headers: dict[str, str]) -> None:
    """Outbox.add's hook: the current context into the event's headers (the caller's own
    traceparent, if it gave one, stands)."""
    if any(name in headers for name in TRACE_HEADERS):
        return
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    headers.update(carrier)


def http_decision(decision: object) -> None:
    """The idempotency middleware's decision as an event on the request's current span:
    ``consumerdedup.idempotency`` with ``consumerdedup.idempotency.decision`` (stored,
    not_stored, replayed, refused) and the status of a response it gave itself."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    kind = type(decision).__name__
    attributes: dict[str, Any] = {}
    if kind == "SendCaptured":
        attributes["consumerdedup.idempotency.decision"] = (
            "stored" if getattr(decision, "stored", False) else "not_stored"
        )
    elif kind == "Respond":
        replayed = bool(getattr(decision, "replayed", False))
        attributes["consumerdedup.idempotency.decision"] = "replayed" if replayed else "refused"
        attributes["http.response.status_code"] = decision.response.status  # type: ignore[attr-defined]
    else:
        return  # PassThrough: not an idempotent route
    span.add_event("consumerdedup.idempotency", attributes)
