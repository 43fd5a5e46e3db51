"""consumerdedup: effectively-once message handling on a SQL database.

A handler wrapped by a Deduplicator runs check -> BEGIN -> handle -> INSERT
processed_events -> COMMIT, and the broker is acked only after COMMIT.
"""

from .async_deduplicator import AsyncDedupHandler, AsyncDeduplicator
from .deduplicator import DedupHandler, Deduplicator
from .errors import (
    ConfigurationError,
    ConsumerDedupError,
    DecodeError,
    InvalidMessage,
    PayloadMismatch,
    PermanentError,
    RecordedFailure,
    RetryLater,
    SimulatedCrash,
)
from .message import MAX_ID_LENGTH, Message
from .observe import OutcomeCounts
from .outbox import Outbox
from .outcome import Outcome, Result
from .pruner import Pruner, PruneReport
from .publisher import BrokerUnavailable, DestinationMissing, Publisher
from .relay import OutboxRelay, RelayConfig
from .retry import RetryPolicy
from .schema import Tables, install
from .settings import DeadLetterFailed

__all__ = [
    "MAX_ID_LENGTH",
    "AsyncDedupHandler",
    "AsyncDeduplicator",
    "BrokerUnavailable",
    "ConfigurationError",
    "ConsumerDedupError",
    "DeadLetterFailed",
    "DecodeError",
    "DedupHandler",
    "Deduplicator",
    "DestinationMissing",
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
    "Publisher",
    "RecordedFailure",
    "RelayConfig",
    "Result",
    "RetryLater",
    "RetryPolicy",
    "SimulatedCrash",
    "Tables",
    "install",
]
