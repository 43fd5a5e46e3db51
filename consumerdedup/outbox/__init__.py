"""The transactional outbox: Outbox.add in the caller's transaction, and the relay that
publishes committed rows through a Publisher."""

from .lock_space import LockTableFull
from .outbox import Outbox
from .publisher import AsyncPublisher, Publisher
from .relay import OutboxRelay, RelayConfig

__all__ = ["AsyncPublisher", "LockTableFull", "Outbox", "OutboxRelay", "Publisher", "RelayConfig"]
