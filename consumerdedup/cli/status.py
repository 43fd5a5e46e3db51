"""The status lines of a long-running command: now and then while it runs, once when it stops.

An operator tailing ``relay`` sees it is alive and what it is behind on without
running ``stats``; a log collector sees when each line was said (``common.say``
stamps them).
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sqlalchemy import Engine

from ..errors import ConfigurationError
from ..schema import Tables
from ..telemetry.readings import outbox_stats
from .common import CommandError, UsageError, parse_duration, say

Counters = Callable[[], dict[str, tuple[str, float]]]
PROGRESS_EVERY = 2.0
"""Seconds between two progress lines of long one-shot work on a terminal."""
STATUS_EVERY = "60s"
"""Default time between two status lines of the relay."""


def relay_line(engine: Engine, tables: Tables, published: int) -> str:
    """published (since start), waiting, the oldest waiting one's age, parked."""
    outbox = outbox_stats(engine, tables.outbox)
    age = outbox["oldest_unpublished_age_seconds"]
    waiting = outbox["unpublished"] - outbox["parked"]
    oldest = "-" if age is None or not waiting else f"{age:.0f}s"  # parked rows count too
    return (
        f"published {published:,} since start, {waiting:,} waiting (oldest {oldest}), "
        f"{outbox['parked']:,} parked"
    )


class StatusLines:
    """A daemon thread saying ``line()`` every ``every`` seconds until ``stop()``.

    A line that cannot be read (the database away) says so and the thread goes on:
    the command's own loop reports and retries its failures.
    """

    def __init__(self, args: argparse.Namespace, every: float, line: Callable[[], str]) -> None:
        self.args, self.every, self.line = args, every, line
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="status-lines", daemon=True)

    def start(self) -> StatusLines:
        if self.every > 0:
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                text = self.line()
            except Exception as exc:  # the loop's own warning says why; keep it short here
                text = f"status unavailable ({type(exc).__name__})"
            say(self.args, text)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


def add_long_running(parser: argparse.ArgumentParser, *, status_every: bool) -> None:
    """``--metrics-port`` (and ``--status-every``) of a long-running command."""
    parser.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus /metrics on this port (needs consumerdedup[prometheus])",
    )
    if status_every:
        parser.add_argument(
            "--status-every",
            metavar="DURATION",
            default=STATUS_EVERY,
            help=f"a status line this often; 0: none (default {STATUS_EVERY})",
        )


@contextmanager
def serving(
    args: argparse.Namespace, engine: Engine, tables: Tables, counters: Counters | None
) -> Iterator[None]:
    """``/metrics`` on ``--metrics-port`` while the block runs, if the option was given."""
    port = getattr(args, "metrics_port", None)
    if port is None:
        yield
        return
    if not 0 < port < 65536:
        raise UsageError(f"--metrics-port must be 1 to 65535, got {port}")
    from ..telemetry.prometheus import serve

    try:
        stop = serve(port, engine, tables, counters)
    except ConfigurationError as error:
        raise UsageError(f"--metrics-port: {error}") from None
    except OSError as error:
        raise CommandError(f"--metrics-port {port}: cannot listen ({error.strerror})") from None
    say(args, f"serving Prometheus metrics on :{port}/metrics")
    try:
        yield
    finally:
        stop()


@contextmanager
def running(
    args: argparse.Namespace, engine: Engine, tables: Tables, published: Callable[[], int]
) -> Iterator[None]:
    """The relay's status lines, its ``/metrics``, and its line when it stops."""
    off = args.status_every.strip() in ("0", "0s")
    every = None if off else parse_duration(args.status_every, "--status-every")
    seconds = every.total_seconds() if every is not None else 0.0

    def counters() -> dict[str, tuple[str, float]]:
        doc = "Events this relay published since it started"
        return {"relay_published_events": (doc, float(published()))}

    def line() -> str:
        return "relay: " + relay_line(engine, tables, published())

    with serving(args, engine, tables, counters):
        lines = StatusLines(args, seconds, line).start()
        try:
            yield
        finally:
            lines.stop()
            try:
                said = relay_line(engine, tables, published())
            except Exception:
                said = f"published {published():,} since start"
            say(args, f"relay stopped: {said}")


@contextmanager
def on_a_terminal(args: argparse.Namespace, line: Callable[[], str]) -> Iterator[None]:
    """A progress line every PROGRESS_EVERY seconds while the block runs, if stdout is a
    terminal (a pipe or a log file gets the final line only)."""
    if not sys.stdout.isatty():
        yield
        return
    lines = StatusLines(args, PROGRESS_EVERY, line).start()
    try:
        yield
    finally:
        lines.stop()
