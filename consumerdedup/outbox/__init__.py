"""The transactional outbox: Outbox.add in the caller's transaction, and the relay that
publishes committed rows through a Publisher."""

from .outbox import Outbox
from .publisher import Publisher
from .relay import OutboxRelay, RelayConfig

__all__ = ["Outbox", "OutboxRelay", "Publisher", "RelayConfig"]
