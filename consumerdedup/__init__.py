"""consumerdedup: effectively-once message handling on a SQL database.

A handler wrapped by a Deduplicator runs check -> BEGIN -> handle -> INSERT
processed_events -> COMMIT, and the broker is acked only after COMMIT.
"""

from typing import TYPE_CHECKING, Any

from .dedup.async_deduplicator import AsyncBulkDedupHandler, AsyncDedupHandler, AsyncDeduplicator
from .dedup.deduplicator import BulkDedupHandler, DedupHandler, Deduplicator
from .dedup.driver_connection import driver_connection
from .dedup.settings import DeadLetterFailed
from .errors import (
    AuthenticationFailed,
    BatchMessageFailed,
    BrokerUnavailable,
    CircuitOpen,
    CommitInHandler,
    ConfigurationError,
    ConsumerDedupError,
    DecodeError,
    DestinationMissing,
    HeldBack,
    InvalidMessage,
    PayloadMismatch,
    PermanentError,
    RecordedFailure,
    RetryLater,
    SimulatedCrash,
    TransactionBroken,
)
from .integrations.process_once import (
    AsyncProcessOnce,
    ProcessOnce,
    process_once,
    process_once_async,
)
from .message import MAX_ID_LENGTH, Message
from .observe import OutcomeCounts
from .outbox.outbox import Outbox
from .outbox.publisher import AsyncPublisher, Publisher
from .outbox.relay import OutboxRelay, RelayConfig
from .outcome import Outcome, Result
from .prune.config import PrunerConfig
from .prune.pruner import Pruner, PruneReport
from .retry import RetryPolicy
from .schema import Tables, install

if TYPE_CHECKING:
    from .app import App


def __getattr__(name: str) -> Any:
    """``consumerdedup.App`` is imported when first asked for: it needs the ``app`` extra
    (pydantic), which the rest of the package does not."""
    if name == "App":
        from .app import App

        return App
    raise AttributeError(f"module 'consumerdedup' has no attribute {name!r}")


__all__ = [
    "MAX_ID_LENGTH",
    "App",
    "AsyncBulkDedupHandler",
    "AsyncDedupHandler",
    "AsyncDeduplicator",
    "AsyncProcessOnce",
    "AsyncPublisher",
    "AuthenticationFailed",
    "BatchMessageFailed",
    "BrokerUnavailable",
    "BulkDedupHandler",
    "CircuitOpen",
    "CommitInHandler",
    "ConfigurationError",
    "ConsumerDedupError",
    "DeadLetterFailed",
    "DecodeError",
    "DedupHandler",
    "Deduplicator",
    "DestinationMissing",
    "HeldBack",
    "InvalidMessage",
    "Message",
    "Outbox",
    "OutboxRelay",
    "Outcome",
    "OutcomeCounts",
    "PayloadMismatch",
    "PermanentError",
    "ProcessOnce",
    "PruneReport",
    "Pruner",
    "PrunerConfig",
    "Publisher",
    "RecordedFailure",
    "RelayConfig",
    "Result",
    "RetryLater",
    "RetryPolicy",
    "SimulatedCrash",
    "Tables",
    "TransactionBroken",
    "driver_connection",
    "install",
    "process_once",
    "process_once_async",
]
