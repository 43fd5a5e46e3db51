"""A worker child's parts, each run in a thread of its own, and what the child tells the
supervisor about them.

A part's ``run()`` that raises an outage (the database or the broker away) is run
again after a backoff, so a service started before its database waits for it
instead of dying; a setup fault or a crash ends the part, and the child with it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from ..reasons import describe
from ..retry import Backoff
from .faults import Fault, fault_of

log = logging.getLogger("consumerdedup.worker")

OUTAGE_BACKOFF = Backoff(timedelta(seconds=1), timedelta(seconds=30))
"""Waits between two runs of a part whose run() met an outage."""


class PartThread:
    """``part.run()`` in a daemon thread, run again after each outage until stopped."""

    def __init__(self, part: Any, stopping: threading.Event) -> None:
        self.part, self.name = part, str(part.name)
        self.stopping = stopping
        self.state = "starting"
        self.error: BaseException | None = None
        """What ended the part, if not a stop: a setup fault or a crash."""
        self.last_error: str | None = None
        self.failures = 0
        self.thread = threading.Thread(target=self._run, name=f"part:{self.name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        while True:
            self.state = "running"
            try:
                self.part.run()
            except BaseException as error:
                kind = fault_of(error)
                self.last_error = describe(error)
                if kind is Fault.OUTAGE and not self.stopping.is_set():
                    self.failures += 1
                    wait = OUTAGE_BACKOFF.delay(self.failures)
                    self.state = "waiting"
                    log.warning(
                        "%s: %s; running it again in %.1fs", self.name, self.last_error, wait,
                        extra={"part": self.name},
                    )  # fmt: skip
                    if self.stopping.wait(wait):
                        break
                    continue
                if kind is not Fault.OUTAGE:
                    self.error = error
                    self.state = "failed"
                    return
                break
            else:
                if not self.stopping.is_set():  # run() returned though nobody asked it to
                    self.error = RuntimeError(f"part {self.name!r} stopped by itself")
                    self.state = "failed"
                    return
                break
        self.state = "stopped"

    @property
    def done(self) -> bool:
        return not self.thread.is_alive()

    def report(self, now: float) -> dict[str, Any]:
        """The part as the supervisor's probes see it."""
        ready = bool(self.state == "running" and self.part.ready)
        if ready:
            self.failures = 0
        return {
            "ready": ready,
            "state": self.state,
            "tick_age": round(now - float(self.part.last_tick), 3),
            "error": None if ready else self._why_not_ready(),
        }

    def _why_not_ready(self) -> str | None:
        if self.state == "running":  # run() itself may be waiting out its database
            return getattr(self.part, "waiting_for", None) or self.last_error
        return self.last_error


class Host:
    """Every part of a child: started together, stopped together with one deadline."""

    def __init__(self, parts: Sequence[Any]) -> None:
        self.stopping = threading.Event()
        self.threads = [PartThread(part, self.stopping) for part in parts]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def failed(self) -> PartThread | None:
        """The first part that ended on its own (a setup fault, a crash), if any."""
        return next((t for t in self.threads if t.done and t.error is not None), None)

    def stop(self, deadline: float) -> None:
        """Ask every part to stop; past ``deadline`` seconds from now, what is in flight is
        given up unacked (the runners' lifecycle contract)."""
        self.stopping.set()
        for thread in self.threads:
            try:
                thread.part.stop(deadline)
            except Exception as error:  # one part's stop must not keep the others running
                log.error("stopping %s raised %s", thread.name, describe(error))

    def wait(self, seconds: float) -> bool:
        """Up to ``seconds`` for every part's thread to end; True if all did."""
        until = time.monotonic() + seconds
        for thread in self.threads:
            thread.thread.join(max(0.0, until - time.monotonic()))
        return all(thread.done for thread in self.threads)

    def close(self) -> None:
        """Close what the parts share (the App's engines: their connections), once each."""
        seen: set[int] = set()
        for thread in self.threads:
            shared = getattr(thread.part, "resources", None)
            if shared is None or id(shared) in seen or not hasattr(shared, "close"):
                continue
            seen.add(id(shared))
            try:
                shared.close()
            except Exception as error:  # closing is best effort: the process exits next
                log.warning("closing %s: %s", thread.name, describe(error))

    def report(self) -> dict[str, Any]:
        now = time.monotonic()
        return {thread.name: thread.report(now) for thread in self.threads}
