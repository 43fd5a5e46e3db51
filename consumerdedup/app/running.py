"""How ``App.run()`` runs its parts in this process: each in a thread until the first
ends (then the others are stopped), or in rounds until idle (tests); SIGTERM and SIGINT
stop them when it runs on the main thread."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .parts import Part


def in_threads(parts: Sequence[Part]) -> None:
    """Each part's run() in a thread; the first to end stops the others; its error raised."""
    done = threading.Event()
    errors: list[BaseException] = []

    def run(part: Part) -> None:
        try:
            part.run()  # type: ignore[attr-defined]
        except BaseException as error:
            errors.append(error)
        finally:
            done.set()

    threads = [threading.Thread(target=run, args=(p,), name=f"part:{p.name}") for p in parts]
    for thread in threads:
        thread.start()
    while not done.wait(0.1):
        pass  # a wait the main thread wakes from for signals
    for part in parts:
        part.stop()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def until_idle(parts: Sequence[Part]) -> None:
    """Rounds of every part until a round handles and publishes nothing: what the relay
    publishes reaches a consumer of the same app in the next round."""
    while True:
        before = sum(p.handled for p in parts)
        for part in parts:
            if part.stopping:
                return
            part.run(until_idle=True)  # type: ignore[attr-defined]
        if sum(p.handled for p in parts) == before:
            return


class stop_on_signals:
    """SIGTERM and SIGINT call ``stop`` while ``run()`` runs on the main thread; the
    previous handlers come back after."""

    def __init__(self, stop: Callable[[], None]) -> None:
        self.stop = stop
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.previous[sig] = signal.signal(sig, lambda signum, frame: self.stop())

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
