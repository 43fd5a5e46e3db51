"""The words flow.decide and its drivers speak: operations, replies and decisions.

flow.decide yields an operation (ReadBody, Claim, Pause, Run, Complete, Release), the
driver sends back its reply (Run: Finished, Overflowed or Crashed; Claim: also
StoreFailed or StoreBusy; Complete: also ClaimLost) and the generator returns a
decision (PassThrough, Respond, SendCaptured). Frozen values, no behaviour; the
protocol itself is in flow.py's docstring. flow re-exports every name here.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .policy import RoutePolicy
from .stored import StoredResponse


@dataclass(frozen=True)
class Incoming:
    """A request as the driver sees it before reading the body."""

    method: str
    path: str
    query: bytes
    headers: tuple[tuple[str, str], ...]
    principal: str | int | None = None


# Operations (yielded)
@dataclass(frozen=True)
class ReadBody:
    limit: int


@dataclass(frozen=True)
class Claim:
    scope: str
    key: str
    fingerprint: str
    policy: RoutePolicy


@dataclass(frozen=True)
class Pause:
    seconds: float


@dataclass(frozen=True)
class Run:
    token: str
    policy: RoutePolicy


@dataclass(frozen=True)
class Complete:
    scope: str
    key: str
    token: str
    response: StoredResponse
    expiry: timedelta


@dataclass(frozen=True)
class Release:
    scope: str
    key: str
    token: str


Operation = ReadBody | Claim | Pause | Run | Complete | Release


# What Run reports
# ``lapsed`` on each: the claim's lease had run out before the run ended (renewals stalled
# or failed: a blocked event loop, an unreachable store), so a twin may have run beside it.
@dataclass(frozen=True)
class Finished:
    """The endpoint answered completely, within max_stored_body."""

    response: StoredResponse
    lapsed: bool = False


@dataclass(frozen=True)
class Overflowed:
    """The endpoint's response grew past max_stored_body: the driver holds what it has."""

    status: int
    lapsed: bool = False


@dataclass(frozen=True)
class Crashed:
    """The endpoint raised, the client went away, or the response never completed."""

    error: BaseException | None
    lapsed: bool = False


RunResult = Finished | Overflowed | Crashed


@dataclass(frozen=True)
class StoreFailed:
    """What a driver sends for a Claim whose store raised (down, unreachable): refuse, run
    nothing; the driver logged the error."""


@dataclass(frozen=True)
class ClaimLost:
    """What a driver sends for a transactional Complete whose transaction no longer held the
    claim (the endpoint rolled the session back): nothing was stored or committed."""


@dataclass(frozen=True)
class StoreBusy:
    """What a driver sends for a transactional Claim on SQLite whose BEGIN IMMEDIATE waited
    past the route's wait: SQLite serialises writers, so the write lock may be held by a
    request with another key. Nothing ran."""


# Decisions (returned)
@dataclass(frozen=True)
class PassThrough:
    """Not ours: call the app as if the middleware were not there."""


@dataclass(frozen=True)
class Respond:
    """Send this response; the endpoint did not run. ``replayed``: add Idempotent-Replayed."""

    response: StoredResponse
    replayed: bool = False


@dataclass(frozen=True)
class SendCaptured:
    """Send what the endpoint produced (or re-raise its error); ``stored`` says if it was kept."""

    stored: bool


Decision = PassThrough | Respond | SendCaptured


def advance(steps: Generator[Operation, Any, Decision], reply: Any) -> Operation | Decision:
    """The next operation, sent the last one's reply; once decide returns, its Decision."""
    try:
        return steps.send(reply)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
