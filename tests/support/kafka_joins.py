"""A fixture that says when aiokafka sends a JoinGroup, for tests that hold a group's join
at the broker (a SIGSTOPped member) and must know the join is there before they stop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest

COORDINATOR_LOG = "aiokafka.consumer.group_coordinator"


@pytest.fixture(name="join_sent")
async def join_sent_fixture() -> AsyncIterator[asyncio.Event]:
    """Set once aiokafka logs that it sends a JoinGroup (its DEBUG line, right before).
    The handler goes with the test: aiokafka's logger outlives the test's event loop, and a
    handler left behind broke later tests' group coordination ('Event loop is closed')."""
    sent = asyncio.Event()
    loop = asyncio.get_running_loop()

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("Sending JoinGroup") and not loop.is_closed():
                loop.call_soon_threadsafe(sent.set)

    coordinator = logging.getLogger(COORDINATOR_LOG)
    seen, level = Seen(logging.DEBUG), coordinator.level
    coordinator.addHandler(seen)
    coordinator.setLevel(logging.DEBUG)
    try:
        yield sent
    finally:
        coordinator.removeHandler(seen)
        coordinator.setLevel(level)
