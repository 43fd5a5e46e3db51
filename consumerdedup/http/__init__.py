"""HTTP idempotency keys: a retried POST runs its endpoint once, on consumerdedup's store.

The algorithm lives in ``flow`` (no I/O); ``asgi`` and ``wsgi`` drive it;
``sql_store`` and ``redis_store`` keep the records (see README: HTTP
idempotency keys).
"""

from __future__ import annotations

from .fingerprint import Fingerprinter, RequestFacts, default_fingerprint, json_fields
from .keys import InvalidIdempotencyKey, parse_key
from .policy import IdempotencyPolicy, RoutePolicy, idempotent
from .store import (
    AsyncIdempotencyStore,
    AsyncTransactionalStore,
    Claimed,
    ClaimResult,
    Completed,
    IdempotencyStore,
    InFlight,
    Mismatch,
    TransactionalStore,
)
from .stored import StoredResponse

__all__ = [
    "AsyncIdempotencyStore",
    "AsyncTransactionalStore",
    "ClaimResult",
    "Claimed",
    "Completed",
    "Fingerprinter",
    "IdempotencyPolicy",
    "IdempotencyStore",
    "InFlight",
    "InvalidIdempotencyKey",
    "Mismatch",
    "RequestFacts",
    "RoutePolicy",
    "StoredResponse",
    "TransactionalStore",
    "default_fingerprint",
    "idempotent",
    "json_fields",
    "parse_key",
]
