"""consumerdedup: effectively-once message handling on a SQL database.

A handler wrapped by a Deduplicator runs check -> BEGIN -> handle -> INSERT
processed_events -> COMMIT, and the broker is acked only after COMMIT.
"""

from .dedup.async_deduplicator import AsyncBulkDedupHandler, AsyncDedupHandler, AsyncDeduplicator
from .dedup.deduplicator import BulkDedupHandler, DedupHandler, Deduplicator
from .dedup.settings import DeadLetterFailed
from .errors import (
    AuthenticationFailed,
    BatchMessageFailed,
    BrokerUnavailable,
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

__all__ = [
    "MAX_ID_LENGTH",
    "AsyncBulkDedupHandler",
    "AsyncDedupHandler",
    "AsyncDeduplicator",
    "AsyncPublisher",
    "AuthenticationFailed",
    "BatchMessageFailed",
    "BrokerUnavailable",
    "BulkDedupHandler",
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
    "install",
]
