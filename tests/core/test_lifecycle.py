"""The stop switch every runner, the relay and the pruner share."""

from __future__ import annotations

import os
import signal
import threading
import time

from consumerdedup.lifecycle import StopSwitch

NOTICED = 0.1
"""The README's promise: stop() (or a stop signal) is noticed within 0.1 s."""
MARGIN = 0.25
"""What a loaded 2-core CI machine may add to a promised delay, in seconds."""


def test_stop_from_another_thread_ends_a_pause_early() -> None:
    switch = StopSwitch()
    started = time.monotonic()
    threading.Timer(0.1, switch.stop).start()
    assert switch.pause(30) is True
    assert 0.1 <= time.monotonic() - started < 0.1 + MARGIN  # woken, not polled


def test_a_stop_signal_is_noticed_within_the_promised_delay() -> None:
    """The handler only sets a flag (it may take no lock): pause() looks at it every 0.1 s."""
    assert threading.current_thread() is threading.main_thread()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    switch = StopSwitch()
    try:
        switch.on_signals()
        started = time.monotonic()
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM)).start()
        assert switch.pause(30) is True
        assert 0.1 <= time.monotonic() - started < 0.1 + NOTICED + MARGIN
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
