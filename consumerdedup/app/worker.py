"""A worker child: ``python -m consumerdedup.app.worker``, started by the supervisor.

It loads the app, builds its parts (``--only`` ones), runs each in a thread, and
twice a second tells the supervisor, over a socket the supervisor handed it, how
each part is doing (ready, its loop's last tick). SIGTERM or SIGINT: every part is
asked to stop with one deadline (in-flight batches commit and are acked, nothing
new is taken), then the child exits 0. A second signal exits at once: nothing was
acked that did not commit, so the broker delivers the rest again. The supervisor
gone (its end of the socket closed) counts as SIGTERM.

Exit codes: 0 stopped cleanly; 1 a crash or a stop past its deadline;
EXIT_SETUP a setup fault (the supervisor stops, exit 1); EXIT_KILLED a second signal.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from types import FrameType
from typing import Any

from ..reasons import describe, mask_passwords
from . import logs
from .faults import Fault, fault_of
from .host import Host

SPEC_ENV = "CONSUMERDEDUP_WORKER_SPEC"
EXIT_SETUP = 3
EXIT_KILLED = 4
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})
"""Blocked by the supervisor while it starts a child, so the child is born with them
blocked (a signal mask survives fork and exec) and unblocks them once its handlers are
in: a stop signal that comes while the child is still importing waits for them, instead
of killing it with the default action (seen: exit 1, "killed by SIGTERM", for a stop in
the first half second of a child's life; under --reload, a worker left without a child)."""
REPORT_EVERY = 0.5
"""Seconds between two reports to the supervisor."""
STOP_SHARE = 0.8
"""Share of the shutdown timeout given to the parts as their stop deadline; the rest is
for closing and exiting before the supervisor's own deadline."""

log = logging.getLogger("consumerdedup.worker")


@dataclass(frozen=True)
class Spec:
    """What a child is told by the supervisor (as JSON in SPEC_ENV)."""

    app: str
    worker: int
    status_fd: int
    shutdown_timeout: float
    only: list[str] | None = None
    env_file: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    log_level: str = "INFO"
    log_format: str = "text"
    log_config: str | None = None
    verbose: bool = False

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> Spec:
        return cls(**json.loads(os.environ[SPEC_ENV]))


class Channel:
    """The child's end of the status socket: JSON lines out, the supervisor's EOF in."""

    def __init__(self, fd: int) -> None:
        self.sock = socket.socket(fileno=fd)
        self.sock.settimeout(2.0)
        self.gone = False

    def send(self, **line: Any) -> None:
        try:
            self.sock.sendall(json.dumps(line).encode() + b"\n")
        except OSError:
            self.gone = True

    def wait(self, seconds: float) -> None:
        """Up to ``seconds``; sets ``gone`` if the supervisor's end closed meanwhile."""
        try:
            readable, _, _ = select.select([self.sock], [], [], seconds)
            if readable and not self.sock.recv(4096):
                self.gone = True
        except OSError:  # a signal during select, or the socket gone: looked at again next turn
            pass


class Signals:
    """Counts stop signals; the second exits at once (the handler takes no lock)."""

    def __init__(self) -> None:
        self.count = 0
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        # Born with them blocked (see STOP_SIGNALS): one that came meanwhile runs now.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.count > 1:
            os.write(
                2, b"consumerdedup worker: second signal, exiting now (nothing unacked lost)\n"
            )
            os._exit(EXIT_KILLED)


def main() -> int:
    spec = Spec.from_env()
    signals = Signals()  # before anything slow: a SIGTERM at start-up is a clean stop too
    channel = Channel(spec.status_fd)
    logs.configure(spec.log_level, spec.log_format, spec.log_config, mask_passwords)
    try:
        from .loading import load_app, load_settings

        settings = load_settings(spec.env_file, spec.overrides)
        app = load_app(spec.app)
        parts = list(app.build(settings, spec.only))
    except Exception as error:
        return fatal(channel, spec, error, building=True)
    _metrics()
    host = Host(parts)
    host.start()
    log.info("worker %d (pid %d) running %s", spec.worker, os.getpid(),
             ", ".join(t.name for t in host.threads))  # fmt: skip
    return serve(spec, host, channel, signals)


def _metrics() -> None:
    try:
        from . import metrics
    except ImportError:  # pragma: no cover - prometheus_client is checked by the supervisor
        return
    if os.environ.get(metrics.MULTIPROC_ENV):
        metrics.install()


def serve(spec: Spec, host: Host, channel: Channel, signals: Signals) -> int:
    next_report = 0.0
    stop_at: float | None = None
    code = 0
    while True:
        now = time.monotonic()
        if stop_at is None and (signals.count or channel.gone):
            why = "signal" if signals.count else "supervisor gone"
            log.info("worker %d stopping (%s): finishing the batches in flight", spec.worker, why)
            stop_at = now + spec.shutdown_timeout * 0.95
            host.stop(spec.shutdown_timeout * STOP_SHARE)
        if stop_at is None and (broken := host.failed()) is not None:
            assert broken.error is not None
            code = fatal(channel, spec, broken.error, part=broken.name)
            stop_at = now + spec.shutdown_timeout * 0.95
            host.stop(spec.shutdown_timeout * STOP_SHARE)
        if now >= next_report:
            channel.send(t="status", stopping=stop_at is not None, parts=host.report())
            next_report = now + REPORT_EVERY
        if stop_at is not None:
            if host.wait(0.1):
                if any(t.error is not None for t in host.threads) and not code:
                    code = 1
                host.close()
                channel.send(t="status", stopping=True, parts=host.report())
                return code
            if time.monotonic() >= stop_at:
                log.error("worker %d: parts still running at the shutdown timeout: %s",
                          spec.worker, [t.name for t in host.threads if not t.done])  # fmt: skip
                logging.shutdown()
                os._exit(1)
        else:
            channel.wait(0.1)


def fatal(
    channel: Channel, spec: Spec, error: BaseException, *, building: bool = False,
    part: str | None = None,
) -> int:  # fmt: skip
    """Tell the supervisor why this child cannot go on; the exit code that says how."""
    kind = Fault.SETUP if building else fault_of(error)
    where = f"{part}: " if part else ""
    line = f"{where}{describe(error)}"
    if building and not isinstance(error, ValueError | ImportError):
        kind = Fault.CRASH  # an app whose build() crashes: its traceback helps
    channel.send(t="fatal", setup=kind is Fault.SETUP, error=line)
    if spec.verbose or kind is Fault.CRASH:
        log.error("worker %d: %s", spec.worker, line, exc_info=error)
    return EXIT_SETUP if kind is Fault.SETUP else 1


if __name__ == "__main__":
    sys.exit(main())
