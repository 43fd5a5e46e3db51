"""``consumerdedup run`` as a real process for the worker's tests: started, probed over
HTTP on the port the OS gave it (read from its log), signalled, and waited for."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[2]
_PORT = re.compile(r"health probes on http://[\d.]+:(\d+)")
T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout: float = 60.0, what: str = "") -> T:
    """``condition()``'s first truthy value, polled until ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or condition}")
        time.sleep(0.05)


class Run:
    """One ``consumerdedup run`` process; its stderr goes to a file the test can read."""

    def __init__(
        self, args: Sequence[str], env: dict[str, str] | None = None, cwd: Path = ROOT
    ) -> None:
        self._log = tempfile.NamedTemporaryFile("w+b", suffix=".log", delete=False)  # noqa: SIM115 - closed by stop()
        self.log_path = Path(self._log.name)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "consumerdedup", "run", *args],
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**os.environ, **(env or {})},
            cwd=cwd,
        )
        self._port: int | None = None
        self._kept: str | None = None  # what it wrote, once stop() removed the file

    @property
    def stderr(self) -> str:
        if self._kept is not None:
            return self._kept
        return self.log_path.read_text(errors="replace")

    @property
    def port(self) -> int:
        if self._port is None:

            def found() -> int | None:
                assert self.process.poll() is None, f"exited early:\n{self.stderr}"
                match = _PORT.search(self.stderr)
                return int(match[1]) if match else None

            self._port = wait_for(found, 60, "the health port in the log")
        return self._port

    def get(self, path: str) -> tuple[int, Any]:
        """(status, JSON body or text) of GET ``path`` on the probes."""
        url = f"http://127.0.0.1:{self.port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                status, body = response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            status, body = error.code, error.read().decode()
        return status, (json.loads(body) if body.startswith("{") else body)

    def status(self, path: str) -> int:
        return self.get(path)[0]

    def child_pids(self) -> list[int]:
        """The pids of the children now running, as /readyz reports them."""
        _, body = self.get("/readyz")
        return sorted(w["pid"] for w in body["workers"] if "pid" in w)

    def signal(self, sig: signal.Signals = signal.SIGTERM) -> None:
        self.process.send_signal(sig)

    def wait(self, timeout: float = 60) -> int:
        code = self.process.wait(timeout)
        return code

    def stop(self) -> None:
        """Whatever state it is in: gone after this (tests' teardown)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._log.close()
        if self._kept is None:
            self._kept = self.log_path.read_text(errors="replace")
        self.log_path.unlink(missing_ok=True)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples with these labels in a Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        sample, _, rest = head.partition("{")
        if sample != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += float(value)
    return total
