"""What a Kafka cluster holds, asked without a runner: which of some topics are missing.

For ``App.check()`` and deploy scripts: a consumer's topics and its dead-letter topics
must exist before it starts (the runner does not create them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient  # type: ignore[import-untyped]

from consumerdedup.event_loop import run_blocking

from .connection import check_bootstrap


async def read_missing_topics(
    bootstrap: str, topics: Sequence[str], *, client_options: Mapping[str, Any] | None = None
) -> list[str]:
    """The topics of ``topics`` the cluster does not have, in the order given."""
    check_bootstrap(bootstrap)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **dict(client_options or {}))
    await admin.start()
    try:
        existing = set(await admin.list_topics())
    finally:
        await admin.close()
    return [topic for topic in topics if topic not in existing]


def missing_topics(
    bootstrap: str,
    topics: Sequence[str],
    *,
    client_options: Mapping[str, Any] | None = None,
    timeout: float = 30.0,
) -> list[str]:
    """``read_missing_topics`` for blocking code (runs its own event loop; a
    ConfigurationError inside a running one)."""

    async def ask() -> list[str]:
        asking = read_missing_topics(bootstrap, topics, client_options=client_options)
        return await asyncio.wait_for(asking, timeout)

    return run_blocking(ask, "missing_topics()", "read_missing_topics(...)")
