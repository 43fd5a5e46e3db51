"""Blocking code running coroutines: on an event loop of its own, made at first use.

An asyncio client (a publisher's producer, an AsyncDeduplicator's engine) binds to
the loop it first ran on, so one loop serves every call until ``close()``. A thread
that runs a loop already cannot block on another: ``loop_running()`` tells.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class OwnLoop:
    """Runs awaitables to completion from blocking code, one at a time, on its own loop."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None

    def run(self, awaitable: Awaitable[T]) -> T:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(_coroutine(awaitable))

    def close(self) -> None:
        """Close the loop, if one was made; the next ``run`` makes a new one."""
        if self._loop is not None:
            self._loop.close()
            self._loop = None


async def _coroutine(awaitable: Awaitable[T]) -> T:
    return await awaitable


def loop_running() -> bool:
    """An event loop runs in this thread (blocking here would block it)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
