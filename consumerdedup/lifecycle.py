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
- When ``RetryPolicy.breaker_threshold`` messages in a row fail for good with the same
  exception type, the runner takes no more: ``run()`` ends with CircuitOpen, and the
  broker keeps every message after them.
- ``stop()`` lets the batch in flight finish, commit and be acked, then ``run()`` returns.
- Where the broker promises order, messages of one partition are handled in that order.

Lifecycle contract (what a host such as ``consumerdedup run`` stands on; each sentence
has a scenario in tests/contracts/runner.py too):
- ``ready`` is True once the start checks passed and the runner consumes its source
  (partitions assigned, queue consumed), and False again when ``run()`` has returned.
- A database away at start is waited for: ``run()`` runs the start checks again with
  backoff, ticking, neither ready nor consuming, until they pass (then it consumes) or
  ``stop()``; a setup fault (a missing table, a refused login) still ends ``run()``. A
  database lost later is the pipeline's outage: the batch is retried, ``ready`` stays.
- ``last_tick`` (``time.monotonic()``) moves at every turn of the consumer loop, idle
  turns too, so a quiet source keeps it fresh and a handler stuck for ever stops it (a
  Kafka fetch that a group rebalance holds at the broker ticks too: it is not stuck).
- ``stop()`` may be called from any thread and from a signal handler: it takes no lock.
- ``stop(deadline)``: past ``deadline`` seconds, what is still in flight is given up, never
  acked (an asyncio runner cancels it; a blocking runner cannot interrupt a handler, so its
  host stops waiting): the broker delivers it again and the dedup table answers.
- ``run()`` installs no signal handler: a host owns the signals (``on_signals()`` is opt-in).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from types import FrameType
from typing import Protocol, runtime_checkable

from . import options
from .breaker import CircuitBreaker
from .outcome import Outcome, Result
from .reasons import describe
from .retry import Backoff, ErrorKind, classify, setup_fault

logger = logging.getLogger("consumerdedup.lifecycle")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

BeforeAck = Callable[[Sequence[Result]], None]

START_BACKOFF = Backoff(timedelta(seconds=0.5), timedelta(seconds=15))
"""Waits between two tries of the start checks while the database is away."""

_SIGNAL_CHECK = 0.1
"""Longest a pause goes without looking at the signal flag."""


class StopSwitch:
    """A stop flag for long-running workers, safe to flip from any thread or a signal
    handler, with the loop's tick and readiness a host reads for its probes."""

    def __init__(self) -> None:
        self._event = threading.Event()
        # Set by stop(), which must take no lock: a signal handler runs on the main thread,
        # possibly while that thread holds the Event's own lock inside pause().
        self._signalled = False
        self._deadline: float | None = None
        self._ready = False
        self.last_tick = time.monotonic()
        """``time.monotonic()`` of the loop's last turn (idle turns and pauses included)."""
        self.waiting_for: str | None = None
        """The outage the start checks wait out, said for a readiness probe; None: none."""

    def stop(self, deadline: float | None = None) -> None:
        """Ask the worker to finish its batch, commit, ack, close and return.

        Takes no lock, so a signal handler may call it. ``deadline``: seconds from now
        after which what is still in flight is given up unacked (see the module's
        lifecycle contract); None waits for it. A waiter on another thread wakes at once,
        one on the main thread (where a signal handler runs) within 0.1 s.
        """
        if deadline is not None:
            seconds = options.number(deadline, "stop(deadline) in seconds", at_least=0)
            self._deadline = time.monotonic() + seconds
        self._signalled = True
        if threading.current_thread() is not threading.main_thread():
            self._event.set()  # never from a signal handler: those run on the main thread

    @property
    def stopping(self) -> bool:
        return self._signalled or self._event.is_set()

    @property
    def deadline_left(self) -> float | None:
        """Seconds until the deadline given to stop() (<= 0: past it); None: none given."""
        return None if self._deadline is None else self._deadline - time.monotonic()

    @property
    def ready(self) -> bool:
        """Start checks passed and consuming (or publishing, pruning): for a readiness probe."""
        return self._ready and not self.stopping

    def _set_ready(self, ready: bool) -> None:
        self._ready = ready
        self.tick()

    def tick(self) -> None:
        """The loop turned: a liveness probe reads ``last_tick``."""
        self.last_tick = time.monotonic()

    def pause(self, seconds: float) -> bool:
        """Sleep, waking early on stop() or a stop signal; True if stop was asked.
        The loop is alive while it pauses: each wake is a tick."""
        deadline = time.monotonic() + seconds
        while not self.stopping and (left := deadline - time.monotonic()) > 0:
            self._event.wait(min(left, _SIGNAL_CHECK))
            self.tick()
        return self.stopping

    def start_checked(self, check: Callable[[], None]) -> bool:
        """Run the start checks (``check``: the processor's or relay's ``check_startup``),
        again with backoff while they meet an outage, ticking; their errors otherwise
        (setup faults) go out as they came. False if stop() came first."""
        failures = 0
        while not self.stopping:
            try:
                check()
                self.waiting_for = None
                return True
            except Exception as error:
                failures += 1
                wait = self._outage_wait(error, failures)
            self.pause(wait)
        return False

    async def start_checked_async(self, check: Callable[[], Awaitable[None]]) -> bool:
        """``start_checked`` for an asyncio runner: its pauses do not block the loop."""
        failures = 0
        while not self.stopping:
            try:
                await check()
                self.waiting_for = None
                return True
            except Exception as error:
                failures += 1
                wait = self._outage_wait(error, failures)
            until = time.monotonic() + wait
            while not self.stopping and (left := until - time.monotonic()) > 0:
                await asyncio.sleep(min(left, _SIGNAL_CHECK))
                self.tick()
        return False

    def _outage_wait(self, error: Exception, failures: int) -> float:
        """Seconds to wait before checking again; raises ``error`` unless it is an outage."""
        if classify(error) is not ErrorKind.TRANSIENT or setup_fault(error):
            raise error
        wait = START_BACKOFF.delay(failures)
        self.waiting_for = describe(error)
        name = getattr(self, "name", type(self).__name__)
        logger.warning(
            "%s: database not reachable at start (%s); checking again in %.1fs",
            name, self.waiting_for, wait,
        )  # fmt: skip
        return wait

    def on_signals(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
        """Stop gracefully on these signals (call from the main thread). Opt-in: nothing
        installs a signal handler unless asked, so a host keeps its own."""

        def handle(signum: int, frame: FrameType | None) -> None:
            self._signalled = True  # the flag alone, whatever thread a test delivers it on

        for sig in signals:
            signal.signal(sig, handle)


@runtime_checkable
class RunningPart(Protocol):
    """One part of a service as a host runs it (a consumer, the relay, the pruner): what
    ``consumerdedup run`` and ``App.run()`` stand on. ``run()`` blocks until stopped (or
    raises a setup fault); the rest is StopSwitch's lifecycle contract above."""

    name: str

    def run(self) -> None: ...

    def stop(self, deadline: float | None = None) -> None: ...

    @property
    def ready(self) -> bool: ...

    @property
    def last_tick(self) -> float: ...


class DeadlinePassed(BaseException):
    """Control flow: a batch committed after the deadline given to ``stop()``; its runner
    acks nothing more and returns. A BaseException, as SimulatedCrash, so that no
    ``except Exception`` on the way swallows it."""


class ConsumerRunner(StopSwitch):
    """Base of every consumer runner: the stop switch, outcome totals, the before_ack hook."""

    def __init__(self, *, before_ack: BeforeAck | None = None) -> None:
        super().__init__()
        self._breaker = CircuitBreaker(None)  # off until the runner gives its processor's
        self.outcomes: Counter[Outcome] = Counter()
        self.before_ack = options.maybe(before_ack, "before_ack", options.function)

    @property
    def breaker(self) -> CircuitBreaker:
        """The circuit breaker this runner stops by (consumerdedup.breaker), to read:
        ``breaker.open`` once ``RetryPolicy.breaker_threshold`` messages in a row FAILED
        with one exception type; from then on the runner is ``stopping`` and not ``ready``,
        takes no more messages, and its ``run()`` ends with CircuitOpen."""
        return self._breaker

    @property
    def stopping(self) -> bool:
        return super().stopping or self._breaker.open

    def _use_breaker(self, breaker: CircuitBreaker) -> None:
        """The runner's processor's breaker (the one its batches are given)."""
        self._breaker = breaker

    def committed(self, results: Sequence[Result]) -> None:
        """Call between the database commit and the acks: counts, then the ``before_ack`` hook.

        The hook sees every batch after its commit and before any ack; tests
        raise SimulatedCrash from it to kill a runner at exactly that point. Past the
        deadline given to stop(), DeadlinePassed instead: nothing more is acked (the
        broker delivers the batch again, and the dedup table answers DUPLICATE).
        """
        self.outcomes.update(result.outcome for result in results)
        if (left := self.deadline_left) is not None and left <= 0:
            raise DeadlinePassed(f"{len(results)} message(s) committed past the stop deadline")
        if self.before_ack is not None:
            self.before_ack(results)

    def gave_up(self, passed: DeadlinePassed) -> None:
        """Say that run() returned at the deadline with a batch unacked."""
        name = getattr(self, "name", type(self).__name__)
        logger.warning("%s: stop deadline passed, %s; it is delivered again", name, passed)
