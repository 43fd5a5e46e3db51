"""One worker child as the supervisor holds it: the process, its status socket, and what
it last said (its parts' readiness and ticks, or why it cannot go on)."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from typing import Any

from .worker import EXIT_KILLED, EXIT_SETUP, SPEC_ENV, STOP_SIGNALS, Spec

log = logging.getLogger("consumerdedup.supervisor")

STALE_REPORT = 5.0
"""Seconds without a report after which a running child counts as not live: its main
thread is stuck (it reports twice a second)."""


class Child:
    """A started worker child. ``poll()`` reads what it said; ``exit_code`` once it ended."""

    def __init__(self, spec: Spec, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair()
        self.sock = ours
        self.sock.setblocking(False)
        spec = replace(spec, status_fd=theirs.fileno())
        self.worker = spec.worker
        self.metrics_dir = env.get("PROMETHEUS_MULTIPROC_DIR")
        self.started = time.monotonic()
        # The child inherits the stop signals blocked until its handlers are in (see
        # worker.STOP_SIGNALS); ours were only held back meanwhile, and run once unblocked.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "consumerdedup.app.worker"],
                env={**env, SPEC_ENV: spec.to_env()},
                pass_fds=(theirs.fileno(),),
                # Its own process group: a Ctrl-C on the terminal reaches the supervisor
                # alone, which stops the children once (a second signal would kill them).
                process_group=0,
            )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        theirs.close()
        self.pid = self.process.pid
        self.parts: dict[str, dict[str, Any]] = {}
        self.reported: float | None = None
        self.stopping = False
        self.fatal: str | None = None
        self.setup_fault = False
        self.ever_ready = False
        self._buffer = b""

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self) -> None:
        """Take in whatever the child said since the last read."""
        while True:
            try:
                data = self.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                return
            self._buffer += data
            *lines, self._buffer = self._buffer.split(b"\n")
            for line in lines:
                self._said(json.loads(line))

    def _said(self, line: dict[str, Any]) -> None:
        if line.get("t") == "status":
            self.parts = line["parts"]
            self.stopping = bool(line.get("stopping"))
            self.reported = time.monotonic()
            if self.ready:
                self.ever_ready = True
        elif line.get("t") == "fatal":
            self.fatal = str(line.get("error"))
            self.setup_fault = bool(line.get("setup"))

    @property
    def exit_code(self) -> int | None:
        return self.process.poll()

    @property
    def ready(self) -> bool:
        return bool(self.parts) and all(p["ready"] for p in self.parts.values())

    def live(self, liveness_timeout: float) -> tuple[bool, str]:
        """Whether the child is alive and every part's loop ticked within the timeout."""
        if self.exit_code is not None:
            return False, f"exited ({self.describe_exit()})"
        now = time.monotonic()
        if self.reported is None:
            age = now - self.started
            return age < max(STALE_REPORT, liveness_timeout), f"starting for {age:.0f}s"
        silent = now - self.reported
        if silent > STALE_REPORT:
            return False, f"no report for {silent:.0f}s (its main thread is stuck)"
        for name, part in self.parts.items():
            # A part waiting out an outage is not stuck: its own retry loop runs.
            if part["state"] == "running" and part["tick_age"] + silent > liveness_timeout:
                return False, f"{name}: its loop has not turned for {part['tick_age']:.0f}s"
        return True, "ok"

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: signal.Signals) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)

    def describe_exit(self) -> str:
        code = self.process.poll()
        if code is None:
            return "running"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        if code == EXIT_SETUP:
            return "setup fault"
        if code == EXIT_KILLED:
            return "exit at once on a second signal"
        return f"exit code {code}"

    def close(self) -> None:
        self.read()
        self.sock.close()
        if self.metrics_dir:  # its live gauges go; its counters stay in the sums
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(self.pid, self.metrics_dir)  # type: ignore[no-untyped-call]
