"""HTTP idempotency keys: a retried POST runs its endpoint once, on consumerdedup's store.

The algorithm lives in ``flow`` (no I/O); ``asgi`` and ``wsgi`` drive it;
``sql_store`` and ``redis_store`` keep the records (see README: HTTP
idempotency keys).
"""

from __future__ import annotations

from .asgi import SESSION_KEY, IdempotencyMiddleware
from .fingerprint import Fingerprinter, RequestFacts, default_fingerprint, json_fields
from .keys import InvalidIdempotencyKey, parse_key
from .policy import IdempotencyPolicy, RoutePolicy, idempotent
from .sql_store import AsyncSqlStore, SqlStore
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
from .transactional import CommitInEndpoint
from .wsgi import WSGIIdempotencyMiddleware

__all__ = [
    "SESSION_KEY",
    "AsyncIdempotencyStore",
    "AsyncSqlStore",
    "AsyncTransactionalStore",
    "ClaimResult",
    "Claimed",
    "CommitInEndpoint",
    "Completed",
    "Fingerprinter",
    "IdempotencyMiddleware",
    "IdempotencyPolicy",
    "IdempotencyStore",
    "InFlight",
    "InvalidIdempotencyKey",
    "Mismatch",
    "RequestFacts",
    "RoutePolicy",
    "SqlStore",
    "StoredResponse",
    "TransactionalStore",
    "WSGIIdempotencyMiddleware",
    "default_fingerprint",
    "idempotent",
    "json_fields",
    "parse_key",
]
