"""The group subscription: the rebalance listener that tells the runner of a revocation."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka import ConsumerRebalanceListener  # type: ignore[import-untyped]

OnRevoked = Callable[[Any], Awaitable[None]]
"""Called with the revoked partitions; the rebalance goes on once it returns."""


class RebalanceListener(ConsumerRebalanceListener):  # type: ignore[misc]
    """Hands a revocation to the runner, which returns once its work in flight is done."""

    def __init__(self, on_revoked: OnRevoked) -> None:
        self.on_revoked = on_revoked

    async def on_partitions_revoked(self, revoked: Any) -> None:
        await self.on_revoked(revoked)

    async def on_partitions_assigned(self, assigned: Any) -> None:
        pass
