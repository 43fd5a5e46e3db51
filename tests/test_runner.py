"""The stop switch every runner, the relay and the pruner share."""

from __future__ import annotations

import signal
import threading
import time

from consumerdedup.runner import StopSwitch


def test_stop_from_another_thread_ends_a_pause_early() -> None:
    switch = StopSwitch()
    threading.Timer(0.1, switch.stop).start()
    started = time.monotonic()
    assert switch.pause(30) is True
    assert time.monotonic() - started < 5


def test_pause_runs_its_course_without_a_stop() -> None:
    switch = StopSwitch()
    started = time.monotonic()
    assert switch.pause(0.3) is False
    assert time.monotonic() - started >= 0.3


def test_a_stop_signal_arriving_while_the_switch_holds_its_own_lock_cannot_deadlock() -> None:
    """A signal handler runs on the main thread, perhaps inside pause() with the Event's
    lock held: it must take no lock, or it would wait on itself forever."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    switch = StopSwitch()
    try:
        switch.on_signals()
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler)
        done = threading.Event()

        def deliver_while_locked() -> None:
            with switch._event._cond:  # as when the signal lands inside Event.wait
                handler(signal.SIGTERM, None)
            done.set()

        thread = threading.Thread(target=deliver_while_locked, daemon=True)
        thread.start()
        assert done.wait(5), "the stop signal handler blocked on the switch's lock"
        assert switch.stopping
        assert switch.pause(30) is True
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
