"""A real WSGI server (waitress) in a subprocess, for the WSGI middleware's tests.

``WsgiServer("tests.http.wsgi_apps:make_app", env)`` starts
``python -m tests.http.wsgi_server tests.http.wsgi_apps:make_app`` with ``env`` added to
the environment; the child calls the factory (no arguments: it reads its settings from the
environment), binds a free loopback port and prints it. The parent waits for that line
with a deadline, never a sleep. ``kill()`` is SIGKILL: a worker that dies mid-request,
with no cleanup of any kind; ``stop()`` is SIGTERM and a wait.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
READY = "wsgi server listening on port "
START_TIMEOUT = 30.0


class WsgiServer:
    def __init__(
        self, factory: str, env: Mapping[str, str] | None = None, *, threads: int = 24
    ) -> None:
        self.factory = factory
        self.env = dict(env or {})
        self.threads = threads
        self.process: subprocess.Popen[str] | None = None
        self.port = 0
        self.output: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> WsgiServer:
        env = {**os.environ, **self.env}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.http.wsgi_server", self.factory, str(self.threads)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.port = self._wait_for_port()
        return self

    def _wait_for_port(self) -> int:
        assert self.process is not None and self.process.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if not selector.select(timeout=max(0.0, deadline - time.monotonic())):
                    continue
                line = self.process.stdout.readline()
                if not line:  # the child ended before it listened
                    self.process.wait(5)
                    raise RuntimeError(f"WSGI server {self.factory} died:\n{self.log()}")
                self.output.append(line)
                if line.startswith(READY):
                    return int(line[len(READY) :])
        self.kill()
        raise RuntimeError(f"WSGI server {self.factory} did not listen in time:\n{self.log()}")

    def log(self) -> str:
        return "".join(self.output)

    def kill(self) -> None:
        """SIGKILL: the process dies wherever it is, as a crashed worker does."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.process.stdout is not None:
            self.output.append(self.process.stdout.read())
            self.process.stdout.close()

    def __enter__(self) -> WsgiServer:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def _load(factory: str) -> Any:
    module, _, name = factory.partition(":")
    return getattr(importlib.import_module(module), name)()


def command(factory: str, port: int, threads: int = 24) -> list[str]:
    """The argv of a server on ``port`` (for tests/http/conftest.py's ServerKind)."""
    return [sys.executable, "-m", "tests.http.wsgi_server", factory, str(threads), str(port)]


def main() -> None:
    import waitress.server

    factory, threads = sys.argv[1], int(sys.argv[2])
    port = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    app = _load(factory)
    # Port 0: the kernel picks a free port; the child says which. threads >= the tests'
    # concurrency, so 20 requests with one key really reach the middleware at once.
    server = waitress.server.create_server(app, host="127.0.0.1", port=port, threads=threads)
    print(f"{READY}{server.effective_port}", flush=True)  # type: ignore[union-attr]
    signal.signal(signal.SIGTERM, lambda *_: server.close())
    with contextlib.suppress(OSError, ValueError):  # the socket closed under it by SIGTERM
        server.run()


if __name__ == "__main__":
    main()
