"""What every consumer runner shares: the stop switch and the signals that flip it.

Runner contract (each sentence has a scenario in tests/contracts/runner.py):
- A message delivered twice is applied once, and every delivery is acked.
- A crash between commit and ack leaves the message with the broker, and its
  redelivery is acked as a DUPLICATE.
- A runner that dies (in a handler, or before acking a batch) leaves everything
  it held with the broker; a restarted runner gets all of it.
- A message that must be retried is not acked and is delivered again.
- A message that fails permanently is dead-lettered with its reason, then acked,
  and the messages after it are processed.
- A message without a usable id is dead-lettered, never guessed.
- ``stop()`` lets the batch in flight finish, commit and be acked, then ``run()`` returns.
- Where the broker promises order, messages of one partition are handled in that order.
"""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from types import FrameType

from .outcome import Outcome, Result

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

BeforeAck = Callable[[Sequence[Result]], None]

_SIGNAL_CHECK = 0.1
"""Longest a pause goes without looking at the signal flag."""


class StopSwitch:
    """A thread-safe stop flag for long-running workers, wired to signals on request."""

    def __init__(self) -> None:
        self._event = threading.Event()
        # Set by the signal handler, which must take no lock: it runs on the main thread,
        # possibly while that thread holds the Event's own lock inside pause().
        self._signalled = False

    def stop(self) -> None:
        """Ask the worker to finish its batch, commit, ack, close and return."""
        self._event.set()

    @property
    def stopping(self) -> bool:
        return self._signalled or self._event.is_set()

    def pause(self, seconds: float) -> bool:
        """Sleep, waking early on stop() or a stop signal; True if stop was asked."""
        deadline = time.monotonic() + seconds
        while not self.stopping and (left := deadline - time.monotonic()) > 0:
            self._event.wait(min(left, _SIGNAL_CHECK))
        return self.stopping

    def on_signals(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
        """Stop gracefully on these signals (call from the main thread)."""

        def handle(signum: int, frame: FrameType | None) -> None:
            self._signalled = True

        for sig in signals:
            signal.signal(sig, handle)


class ConsumerRunner(StopSwitch):
    """Base of every consumer runner: the stop switch, outcome totals, the before_ack hook."""

    def __init__(self, *, before_ack: BeforeAck | None = None) -> None:
        super().__init__()
        self.outcomes: Counter[Outcome] = Counter()
        self.before_ack = before_ack

    def committed(self, results: Sequence[Result]) -> None:
        """Call between the database commit and the acks: counts, then the ``before_ack`` hook.

        The hook sees every batch after its commit and before any ack; tests
        raise SimulatedCrash from it to kill a runner at exactly that point.
        """
        self.outcomes.update(result.outcome for result in results)
        if self.before_ack is not None:
            self.before_ack(results)
