"""Heartbeats for an idle publisher's BlockingConnection.

pika's BlockingConnection reads and writes only while one of its methods runs: its
heartbeat timer fires inside ``process_data_events``, and nowhere else. A publisher that
sits between relay rounds for longer than about two heartbeat intervals is dropped by the
broker, and the next publish meets a dead socket (pika's loggers then write a burst of
ERROR lines and tracebacks). ``KeepAlive`` calls ``process_data_events(0)`` on the
connection four times per heartbeat interval from a daemon thread, under the publisher's
lock, so it never runs beside a publish (pika's connection is not thread-safe).

The consumer runner needs none of this: it waits for deliveries inside
``process_data_events``, so it answers heartbeats while its queue is quiet.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import pika.exceptions  # type: ignore[import-untyped]

from .connection import losses_handled

TICKS_PER_HEARTBEAT = 4
"""The broker waits about two silent intervals; four ticks per interval leave slack for a
tick held back by a publish that holds the lock."""
MIN_TICK = 0.1
"""Seconds: the shortest tick, whatever the heartbeat."""


def heartbeat(connection: Any) -> float:
    """The heartbeat interval the broker and we agreed on, in seconds (0: none). pika keeps
    it on the connection's parameters after the tune."""
    params = getattr(getattr(connection, "_impl", None), "params", None)
    agreed = getattr(params, "heartbeat", None)
    return float(agreed) if isinstance(agreed, int | float) and agreed > 0 else 0.0


class KeepAlive:
    """Answers heartbeats on ``watch``-ed connections while nobody else uses them.

    ``lock`` is the lock every other use of the connection holds. ``on_lost``, a method of
    the owner, is called (under that lock) with pika's error when a tick finds the
    connection gone: the owner drops it and reconnects at its next use. The owner is held
    weakly: one dropped without closing ends the thread at its next tick.
    """

    def __init__(self, lock: threading.Lock, on_lost: Callable[[BaseException], None]) -> None:
        self._lock = lock
        self._on_lost = weakref.WeakMethod(on_lost)
        self._connection: Any = None
        self._stop: threading.Event | None = None  # the running thread's, if one runs

    def watch(self, connection: Any) -> None:
        """Keep ``connection`` alive from now on (call under the lock)."""
        self._connection = connection
        interval = heartbeat(connection)
        if interval and self._stop is None:
            self._stop = stop = threading.Event()
            tick = max(interval / TICKS_PER_HEARTBEAT, MIN_TICK)
            name = "consumerdedup-rabbitmq-keepalive"
            threading.Thread(target=self._run, args=(tick, stop), name=name, daemon=True).start()

    def forget(self) -> None:
        """The connection was dropped or closed (call under the lock): its thread ends."""
        self._connection = None
        if self._stop is not None:
            self._stop.set()
            self._stop = None

    def _run(self, tick: float, stop: threading.Event) -> None:
        while not stop.wait(tick):
            with self._lock, losses_handled():
                if stop.is_set():  # forgotten: a later connection has a thread of its own
                    return
                on_lost = self._on_lost()
                if on_lost is None:  # its owner was dropped without closing
                    self.forget()
                    return
                try:
                    self._connection.process_data_events(time_limit=0)
                except pika.exceptions.AMQPError as exc:
                    self.forget()
                    on_lost(exc)
                    return
