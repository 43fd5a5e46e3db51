"""Blocking code running coroutines: on an event loop of its own, made at first use.

An asyncio client (a publisher's producer, an AsyncDeduplicator's engine) binds to
the loop it first ran on, so one loop serves every call until ``close()``. A thread
that runs a loop already cannot block on another: ``loop_running()`` tells, and
``run_blocking`` refuses there before it makes the coroutine (none is left unawaited).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from .errors import ConfigurationError

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


def run_blocking(make: Callable[[], Coroutine[Any, Any, T]], what: str, instead: str) -> T:
    """``asyncio.run(make())`` for blocking code; ConfigurationError naming ``instead`` (the
    coroutine to await) when a loop runs in this thread, raised before ``make`` is called:
    ``asyncio.run`` would refuse and leave the coroutine never awaited."""
    if loop_running():
        raise ConfigurationError(
            f"{what} blocks on an event loop of its own and cannot run inside the one running "
            f"in this thread: from asyncio code await {instead}, or run the blocking call in "
            "a thread (await asyncio.to_thread(...))"
        )
    return asyncio.run(make())
