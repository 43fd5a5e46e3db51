"""Where telemetry plugs into the message path: six slots, empty until ``instrument()``.

The per-message code reads a slot and goes on when it is None: one global read
per batch, nothing imported, no allocation. This module imports nothing, so the
lowest layers may read it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol


class ProcessHook(Protocol):
    """Told when a runner hands deliveries to a handler and what became of them."""

    def start(self, consumer: str, deliveries: Sequence[Any]) -> ProcessToken: ...


class ProcessToken(Protocol):
    def finish(self, results: Sequence[Any]) -> None: ...
    def fail(self, error: BaseException) -> None: ...


SendWindow = Callable[[Sequence[Any]], list[Any]]

process: ProcessHook | None = None
"""The runners' processor calls ``start`` before a batch and ``finish`` after it."""
send: Callable[[object, Sequence[Any], SendWindow], list[Any]] | None = None
"""The relay's Sender publishes a window through ``send(publisher, messages, publish)``."""
outbox_headers: Callable[[dict[str, str]], None] | None = None
"""``Outbox.add`` lets it add the current trace context to a new event's headers."""
http_decision: Callable[[object], None] | None = None
"""The HTTP idempotency flow tells it each request's decision (a span event)."""
http_lease_expired: Callable[[str], None] | None = None
"""The HTTP idempotency flow tells it (with the request's method) that an endpoint ran past
its claim's lease: a counter, ``consumerdedup.http.lease_expired``."""
breaker: Callable[[str, str, bool], None] | None = None
"""A consumer's circuit breaker tells it ``(consumer, error type, open)`` when it opens
(True) or is reset (False)."""
