"""Every refusal as RFC 9457 ``application/problem+json``: a type, a title, what to do next.

The type URIs are tag URIs (RFC 4151): stable names a client can switch on,
not pages to fetch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from .stored import StoredResponse

TYPE_BASE = "tag:consumerdedup,2026:idempotency:"
CONTENT_TYPE = "application/problem+json"


@dataclass(frozen=True)
class Problem:
    """One problem response; ``headers`` are added to Content-Type."""

    status: int
    name: str
    title: str
    detail: str
    headers: tuple[tuple[str, str], ...] = field(default=())

    @property
    def type(self) -> str:
        return TYPE_BASE + self.name

    def response(self) -> StoredResponse:
        document = {"type": self.type, "title": self.title, "status": self.status}
        document["detail"] = self.detail
        body = json.dumps(document).encode()
        headers = (
            ("content-type", CONTENT_TYPE),
            ("content-length", str(len(body))),
            ("cache-control", "no-store"),
            *self.headers,
        )
        return StoredResponse(self.status, headers, body)


def malformed_key(reason: str) -> Problem:
    return Problem(400, "key-malformed", "Malformed Idempotency-Key header", f"{reason}.")


def missing_key() -> Problem:
    return Problem(
        400,
        "key-missing",
        "Idempotency-Key header required",
        "This endpoint needs an Idempotency-Key header: send a new unique key (e.g. a UUID) with "
        "each new operation and the same key when you retry it.",
    )


def in_flight(retry_after: float) -> Problem:
    seconds = max(1, math.ceil(retry_after))
    return Problem(
        409,
        "in-flight",
        "A request with this Idempotency-Key is in progress",
        f"Another request with this key has not finished yet; retry the same request with the "
        f"same key after {seconds} s to get its response.",
        (("retry-after", str(seconds)),),
    )


def mismatch() -> Problem:
    return Problem(
        422,
        "key-reused",
        "Idempotency-Key reused with a different request",
        "This key was first used with a different request (method, path, query or body); retry "
        "with exactly the first request, or send a new key for a new operation.",
    )


def not_stored(status: int) -> Problem:
    return Problem(
        409,
        "response-not-stored",
        "The request with this Idempotency-Key completed, but its response was not stored",
        f"The first request with this key ran and answered {status}, with a response too large "
        "(or streamed) to keep for replay. Do not retry it: look the result up (e.g. with a GET), "
        "or send a new key for a new operation.",
    )


def body_too_large(limit: int) -> Problem:
    return Problem(
        413,
        "request-too-large",
        "Request body too large for an idempotent request",
        f"Requests with an Idempotency-Key may carry at most {limit} bytes here; send a smaller "
        "body.",
    )


def store_unavailable() -> Problem:
    return Problem(
        503,
        "store-unavailable",
        "The idempotency-key store is unavailable",
        "Nothing was done: the server could not record this request's key. Retry the same "
        "request with the same key later.",
        (("retry-after", "1"),),
    )


def commit_failed() -> Problem:
    return Problem(
        503,
        "not-committed",
        "The operation did not commit",
        "Nothing was done; retry the same request with the same key.",
        (("retry-after", "1"),),
    )


def claim_lost() -> Problem:
    return Problem(
        500,
        "claim-lost",
        "The endpoint ended the request's transaction",
        "Nothing of this request was committed or stored: the endpoint rolled back the "
        "transaction its idempotency claim lived in. A retry with the same key gets the "
        "response of whichever request holds the key, or runs it if none did.",
    )


def store_busy() -> Problem:
    return Problem(
        409,
        "store-busy",
        "The request could not claim its Idempotency-Key yet",
        "Nothing was done: this endpoint commits in one SQLite transaction, and SQLite runs one "
        "writing transaction at a time; another request (with this key, or with any other key) "
        "held the database's write lock past this route's wait. Retry the same request with "
        "the same key after 1 s.",
        (("retry-after", "1"),),
    )
