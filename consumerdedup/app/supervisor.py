"""The supervisor of ``consumerdedup run``: ``workers`` children, kept running.

- A child that dies is started again after a backoff. One that dies before it was
  ever ready, ``start_attempts`` times in a row, stops the worker: exit 1 with the
  child's own error, not a restart loop. A setup fault (wrong password, missing
  table) stops it at the first: restarting cannot fix it.
- SIGTERM or SIGINT: each child is told once and finishes its batches in flight; the
  supervisor exits 0 when all stopped cleanly, 1 at ``shutdown_timeout`` (the rest is
  killed: unacked, so delivered again). A second signal kills every child at once.
- Under ``reload``, ``restart()`` (from the file watcher) replaces every child, and
  start-up deaths wait for the next change instead of stopping the worker.
The health probes read ``health()`` from another thread.
"""

from __future__ import annotations

import logging
import select
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from types import FrameType
from typing import Any

from ..retry import Backoff
from .children import Child

log = logging.getLogger("consumerdedup.supervisor")

RESTART_BACKOFF = Backoff(timedelta(seconds=0.5), timedelta(seconds=30))
START_ATTEMPTS = 3
"""Start-up deaths in a row (no readiness between them) that stop the worker."""
TURN = 0.1


@dataclass
class Slot:
    """A place for one child: the one running now, and its history."""

    worker: int
    child: Child | None = None
    start_failures: int = 0
    restarts: int = 0
    restart_at: float = 0.0
    last_error: str | None = None


@dataclass
class Outcome:
    code: int
    error: str | None = None


@dataclass
class Health:
    """What the probes answer, read under the supervisor's lock."""

    live: bool
    ready: bool
    workers: list[dict[str, Any]] = field(default_factory=list)


class Supervisor:
    def __init__(
        self,
        launch: Callable[[int], Child],
        workers: int,
        shutdown_timeout: float,
        liveness_timeout: float,
        *,
        reload: bool = False,
        start_attempts: int = START_ATTEMPTS,
    ) -> None:
        self.launch, self.shutdown_timeout = launch, shutdown_timeout
        self.liveness_timeout, self.reload = liveness_timeout, reload
        self.start_attempts = start_attempts
        self.slots = [Slot(i) for i in range(workers)]
        self.signals = 0
        self.stop_deadline: float | None = None
        self.outcome: Outcome | None = None
        self._restart_all = False
        self._killed = False
        self._lock = threading.Lock()

    # -- signals (the handler takes no lock: it only counts) --
    def on_signals(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._signalled)

    def _signalled(self, signum: int, frame: FrameType | None) -> None:
        self.signals += 1

    def restart(self) -> None:
        """Replace every child (the reloader, on a change of the source)."""
        self._restart_all = True

    # -- the loop --
    def run(self) -> Outcome:
        for slot in self.slots:
            self._start(slot)
        while True:
            self._turn()
            if self.outcome is not None and self._all_ended():
                self._close_all()
                return self.outcome

    def _turn(self) -> None:
        children = [s.child for s in self.slots if s.child is not None]
        try:
            readable, _, _ = select.select(children, [], [], TURN)
        except InterruptedError:
            readable = []
        with self._lock:
            for child in readable:
                child.read()
            if self.signals >= 2 and not self._killed:
                self._kill_all("a second signal: stopping at once")
            elif self.signals and self.stop_deadline is None:
                self._stop_all(Outcome(0), "a stop signal: finishing the batches in flight")
            if self._restart_all and self.stop_deadline is None:
                self._restart_all = False
                log.warning("source changed: restarting the workers")
                for slot in self.slots:
                    slot.start_failures, slot.restart_at = 0, 0.0
                    if slot.child is not None:
                        slot.child.terminate()
            for slot in self.slots:
                self._watch(slot)
            late = self.stop_deadline is not None and time.monotonic() >= self.stop_deadline
            if late and not self._killed:
                self._kill_all(f"children still running at the shutdown timeout "
                               f"({self.shutdown_timeout:g}s)")  # fmt: skip

    def _watch(self, slot: Slot) -> None:
        child = slot.child
        if child is None:
            if self.stop_deadline is None and time.monotonic() >= slot.restart_at:
                self._start(slot)
            return
        code = child.exit_code
        if code is None:
            if child.ready:
                slot.start_failures = 0
            return
        child.close()
        slot.child = None
        said = child.fatal or f"worker {slot.worker} {child.describe_exit()}"
        if self.stop_deadline is not None:
            if code != 0 and self.outcome is not None and self.outcome.code == 0:
                self.outcome = Outcome(1, f"worker {slot.worker} {child.describe_exit()}")
            return
        slot.last_error = said
        if self.reload:  # wait for the next change rather than loop on a broken source
            if code == 0:  # stopped for a reload: its successor starts now
                slot.restart_at = 0.0
                return
            log.error("worker %d: %s", slot.worker, said)
            slot.restart_at = time.monotonic() + (1e9 if not child.ever_ready else 1.0)
            return
        if child.setup_fault:
            self._stop_all(Outcome(1, said), f"worker {slot.worker}: {said}")
            return
        if not child.ever_ready:
            slot.start_failures += 1
            if slot.start_failures >= self.start_attempts:
                why = f"worker {slot.worker} died at start-up {slot.start_failures} times: {said}"
                self._stop_all(Outcome(1, why), why)
                return
        wait = RESTART_BACKOFF.delay(max(slot.start_failures, 1))
        log.error("worker %d (pid %d) died: %s; restarting in %.1fs",
                  slot.worker, child.pid, said, wait)  # fmt: skip
        slot.restarts += 1
        slot.restart_at = time.monotonic() + wait

    def _start(self, slot: Slot) -> None:
        slot.child = self.launch(slot.worker)
        log.info("worker %d started (pid %d)", slot.worker, slot.child.pid)

    def _stop_all(self, outcome: Outcome, why: str) -> None:
        (log.info if outcome.code == 0 else log.error)("stopping: %s", why)
        self.outcome = outcome
        self.stop_deadline = time.monotonic() + self.shutdown_timeout
        for slot in self.slots:
            if slot.child is not None:
                slot.child.terminate()

    def _kill_all(self, why: str) -> None:
        log.error("killing the workers: %s (what was not acked is delivered again)", why)
        self._killed = True
        self.outcome = Outcome(1, why)
        self.stop_deadline = time.monotonic()
        for slot in self.slots:
            if slot.child is not None:
                slot.child.kill()

    def _all_ended(self) -> bool:
        return all(s.child is None for s in self.slots)

    def _close_all(self) -> None:
        for slot in self.slots:
            if slot.child is not None:
                slot.child.kill()
                slot.child.process.wait()
                slot.child.close()
                slot.child = None

    # -- for the probes (another thread) --
    def health(self) -> Health:
        with self._lock:
            stopping = self.stop_deadline is not None
            health = Health(live=True, ready=not stopping)  # a stop in order is not a fault
            for slot in self.slots:
                child = slot.child
                entry: dict[str, Any] = {"worker": slot.worker, "restarts": slot.restarts}
                if child is None:
                    entry.update(state="restarting", error=slot.last_error)
                    health.ready = False
                else:
                    live, why = child.live(self.liveness_timeout)
                    entry.update(pid=child.pid, live=live, why=why, ready=child.ready,
                                 parts=child.parts)  # fmt: skip
                    health.live &= live or stopping
                    health.ready &= child.ready
                health.workers.append(entry)
            return health
