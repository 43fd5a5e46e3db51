"""The idempotency-key algorithm, once, as a generator that does no I/O.

``decide(request, policy)`` yields operations (read the body, claim, pause,
run the endpoint, complete, release) and is sent each one's result; it
returns what the driver must do with the response. The ASGI and the WSGI
middleware are drivers: they only carry the operations out, so the two can
never disagree on a rule.

Operations and what the driver sends back:
    ReadBody(limit)      -> the whole request body, or None if it is longer than limit
    Claim(...)           -> a store.ClaimResult (transactional: claim_in the request's session),
                            or StoreFailed when the store raised (nothing was claimed), or
                            StoreBusy (SQLite transactional: the write lock is taken)
    Pause(seconds)       -> None, after sleeping
    Run(token)           -> Finished | Overflowed | Crashed (renewing the lease meanwhile)
    Complete(...)        -> bool: stored (transactional: stored and committed), or
                            ClaimLost (transactional: the endpoint rolled back; nothing kept)
    Release(...)         -> None (transactional: rolled back)
Returned decisions: PassThrough, Respond(response), SendCaptured. These values are
defined in operations.py and importable from here.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Generator
from typing import Any

from ..errors import ConfigurationError
from ..telemetry import hooks
from . import problems
from .fingerprint import RequestFacts
from .keys import HEADER, InvalidIdempotencyKey, key_label, parse_key
from .operations import (
    Claim,
    ClaimLost,
    Complete,
    Crashed,
    Decision,
    Finished,
    Incoming,
    Operation,
    Overflowed,
    PassThrough,
    Pause,
    ReadBody,
    Release,
    Respond,
    Run,
    RunResult,
    SendCaptured,
    StoreBusy,
    StoreFailed,
    advance,
)
from .policy import IdempotencyPolicy, RoutePolicy
from .store import Claimed, ClaimResult, Completed, Mismatch
from .stored import StoredResponse

log = logging.getLogger("consumerdedup.http")

RETRYABLE_STATUSES = frozenset({408, 425, 429})
"""4xx answers that mean "try again later", not "this input is wrong": never stored."""
SCOPE_LENGTH = 255
_FIRST_POLL = 0.02
_LONGEST_POLL = 0.5


def scope_of(method: str, path: str, principal: str | int | None) -> str:
    """Principal + method + route; the principal only as a digest (it may be an API key).

    A principal is a str, or an int (a user id, as str(id)); anything else is refused: its
    str() may differ between requests of one caller (a default repr holds an address)."""
    if isinstance(principal, int) and not isinstance(principal, bool):
        principal = str(principal)
    if principal is not None and not isinstance(principal, str):
        raise ConfigurationError(
            f"the idempotency principal callable returned a {type(principal).__qualname__}; "
            "return a str (or an int id) that names the caller, e.g. str(user.id), or None"
        )
    scope = f"{method.upper()} {path}"
    if principal is not None:
        scope += " @" + hashlib.sha256(principal.encode("utf-8")).hexdigest()[:32]
    if len(scope) > SCOPE_LENGTH:
        scope = f"{method.upper()} sha256:{hashlib.sha256(scope.encode('utf-8')).hexdigest()}"
    return scope


def should_store(status: int, route: RoutePolicy | None = None) -> bool:
    """2xx and 4xx (and 3xx) are answers to keep; 5xx, "retry later" 4xx and the route's
    ``unstored_statuses`` are not."""
    if route is not None and status in route.unstored_statuses:
        return False
    return status < 500 and status not in RETRYABLE_STATUSES


def _lease_lapsed(where: str, label: str, route: RoutePolicy) -> None:
    """Said when it happens: the endpoint outlived its lease, a twin may have run it too."""
    log.warning(
        "idempotency lease expired %s %s: the endpoint ran past its %g s lease without a "
        "renewal (a blocked event loop or an unreachable store); a twin may have run it "
        "again. Its result is stored only if no other request took the key meanwhile",
        where,
        label,
        route.lease.total_seconds(),
    )
    if hooks.http_lease_expired is not None:
        hooks.http_lease_expired(where.split(" ", 1)[0])


def decide(
    request: Incoming, policy: IdempotencyPolicy, *, lock_waits: bool = True
) -> Generator[Operation, Any, Decision]:
    """``_decide``, its decision told to telemetry (a span event on the request's span)."""
    decision = yield from _decide(request, policy, lock_waits=lock_waits)
    if hooks.http_decision is not None:
        hooks.http_decision(decision)
    return decision


def _decide(
    request: Incoming, policy: IdempotencyPolicy, *, lock_waits: bool = True
) -> Generator[Operation, Any, Decision]:
    """The algorithm for one request (see the module docstring for the protocol).

    ``lock_waits``: a transactional claim waits for its twin on the row lock in the store
    (the driver passes the route's wait to claim_in); False: the driver claims without
    waiting and the twin's wait is spent here, in Pauses, holding no thread or connection
    (an ASGI server over a blocking engine, whose few worker threads must stay free).
    """
    route = policy.for_request(request.method, request.path)
    if route is None:
        return PassThrough()
    where = f"{request.method.upper()} {request.path}"
    try:
        key = parse_key(v for n, v in request.headers if n.lower() == HEADER)
    except InvalidIdempotencyKey as error:
        log.info("idempotency refused %s: malformed key", where)
        return Respond(problems.malformed_key(str(error)).response())
    if key is None:
        if route.required:
            log.info("idempotency refused %s: key missing", where)
            return Respond(problems.missing_key().response())
        return PassThrough()
    label = key_label(key)
    body = yield ReadBody(route.max_request_body)
    if body is None:
        log.info(
            "idempotency refused %s %s: body over %d bytes", where, label, route.max_request_body
        )
        return Respond(problems.body_too_large(route.max_request_body).response())
    facts = RequestFacts(request.method.upper(), request.path, request.query, body, request.headers)
    fingerprint = route.fingerprint(facts)
    if not isinstance(fingerprint, str):  # a setup fault: loud (500), never a store outage
        raise ConfigurationError(
            f"RoutePolicy.fingerprint returned a {type(fingerprint).__qualname__}; "
            "a fingerprinter returns a str (e.g. a hex digest)"
        )
    scope = scope_of(request.method, request.path, request.principal)
    waits_in_store = route.transactional and lock_waits
    claim = Claim(scope, key, fingerprint, route)
    claimed = yield from _claim(claim, where, label, waits_in_store)
    if not isinstance(claimed, Claimed):
        return claimed
    log.info("idempotency claimed %s %s", where, label)
    ran: RunResult = yield Run(claimed.token, route)
    if ran.lapsed:
        _lease_lapsed(where, label, route)
    if isinstance(ran, Crashed):
        yield Release(scope, key, claimed.token)
        log.info("idempotency released %s %s: the endpoint did not complete", where, label)
        return SendCaptured(stored=False)
    if isinstance(ran, Finished) and not should_store(ran.response.status, route):
        yield Release(scope, key, claimed.token)
        log.info(
            "idempotency released %s %s: status %d is not stored", where, label, ran.response.status
        )
        return SendCaptured(stored=False)
    if isinstance(ran, Overflowed):
        kept = StoredResponse.unreplayable(ran.status)
        log.warning(
            "idempotency not stored %s %s: response over %d bytes or streamed; a retry "
            "gets 409 response-not-stored",
            where,
            label,
            route.max_stored_body,
        )
    else:
        kept = ran.response
        if not kept.replayable:
            log.warning(
                "idempotency not stored %s %s: %s; a retry gets 409 response-not-stored",
                where,
                label,
                kept.why_not,
            )
    stored = yield Complete(scope, key, claimed.token, kept, route.expiry)
    if isinstance(stored, ClaimLost):
        log.error("idempotency claim lost %s %s: nothing committed", where, label)
        return Respond(problems.claim_lost().response())
    if not stored and route.transactional:
        log.warning("idempotency commit failed %s %s: nothing done, retry runs", where, label)
        return Respond(problems.commit_failed().response())
    if not stored:
        log.warning(
            "idempotency claim lost %s %s: the lease ran out before the endpoint "
            "finished; its response was not stored",
            where,
            label,
        )
    return SendCaptured(stored=bool(stored))


def _claim(
    claim: Claim, where: str, label: str, waits_in_store: bool
) -> Generator[Operation, Any, Claimed | Respond]:
    """Claim, pausing for an in-flight twin while the route's wait allows (unless the store
    already waited on the row lock)."""
    waited = 0.0
    poll = _FIRST_POLL
    budget = 0.0 if waits_in_store else claim.policy.wait.total_seconds()
    while True:
        result: ClaimResult | StoreBusy = yield claim
        if isinstance(result, Claimed):
            return result
        if isinstance(result, StoreFailed):
            log.warning("idempotency refused %s %s: the store failed", where, label)
            return Respond(problems.store_unavailable().response())
        if isinstance(result, Mismatch):
            log.info("idempotency mismatch %s %s: key reused with another request", where, label)
            return Respond(problems.mismatch().response())
        if isinstance(result, Completed):
            if not result.response.replayable:
                log.info("idempotency not stored %s %s: refused a retry", where, label)
                return Respond(problems.not_stored(result.response.status).response())
            log.info("idempotency replayed %s %s", where, label)
            return Respond(result.response, replayed=True)
        # StoreBusy: a twin, or another key (SQLite's one writer): waited for alike.
        # A twin's 409 says retry soon (the route's retry_after, about a typical run), never
        # after the whole rest of its lease (a minute by default): it is renewed while it runs.
        retry_after = 1.0 if isinstance(result, StoreBusy) else result.retry_after
        told = min(retry_after, claim.policy.retry_after.total_seconds())
        if waited >= budget and isinstance(result, StoreBusy):
            log.info("idempotency refused %s %s: the database is busy (SQLite)", where, label)
            return Respond(problems.store_busy().response())
        if waited >= budget:
            log.info("idempotency in flight %s %s", where, label)
            return Respond(problems.in_flight(told).response())
        step = min(poll, budget - waited, retry_after or poll)
        yield Pause(max(step, 0.001))
        waited += step
        poll = min(poll * 2, _LONGEST_POLL)


__all__ = [
    "RETRYABLE_STATUSES",
    "SCOPE_LENGTH",
    "Claim",
    "ClaimLost",
    "Complete",
    "Crashed",
    "Decision",
    "Finished",
    "Incoming",
    "Operation",
    "Overflowed",
    "PassThrough",
    "Pause",
    "ReadBody",
    "Release",
    "Respond",
    "Run",
    "RunResult",
    "SendCaptured",
    "StoreBusy",
    "StoreFailed",
    "advance",
    "decide",
    "scope_of",
    "should_store",
]
