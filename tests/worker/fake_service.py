"""A stand-in App for the worker's own tests: the seam's methods over parts whose behaviour
the test picks with environment variables (FAKE_*), so that a test can make a part hang, crash,
meet an outage or a setup fault, and see what the worker does about it.

Each part appends a line to FAKE_DIR/<part>.<pid> at each turn of its loop ("tick"), and
writes FAKE_DIR/<part>.<pid>.stopped when its run() returns after a stop.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from consumerdedup.errors import ConfigurationError
from consumerdedup.startup import FAIL, Check

TURN = 0.05


def _env(name: str) -> str:
    return os.environ.get(f"FAKE_{name}", "")


class FakePart:
    def __init__(self, name: str, folder: Path) -> None:
        self.name = name
        self.folder = folder
        self._stop = threading.Event()
        self.deadline: float | None = None
        self.ready = False
        self.last_tick = time.monotonic()

    def run(self) -> None:
        mine = self.folder / f"{self.name}.{os.getpid()}"
        if _env("SETUP_FAULT") == self.name:
            raise ConfigurationError(
                f"table processed_events not found; run `consumerdedup init-db` ({self.name})"
            )
        if _env("CRASH") == self.name:
            raise RuntimeError(f"{self.name} crashed at start")
        if (gate := _env("OUTAGE_UNTIL")) and not Path(gate).exists():
            raise ConnectionRefusedError(f"{self.name}: database away")
        self.ready = True
        turns = 0
        while not self._stop.is_set():
            self.last_tick = time.monotonic()
            with mine.open("a") as out:
                out.write("tick\n")
            turns += 1
            hang = _env("HANG")
            if hang == self.name and Path(self.folder / "hang").exists():
                threading.Event().wait()  # a handler stuck for ever
            if _env("BUSY_STOP") == self.name and self._stop.wait(0):
                break
            self._stop.wait(TURN)
        if _env("SLOW_STOP") == self.name:  # a batch in flight that takes its time
            time.sleep(float(_env("SLOW_STOP_SECONDS") or 1))
        self.ready = False
        (self.folder / f"{self.name}.{os.getpid()}.stopped").write_text(f"{turns}\n")

    def stop(self, deadline: float | None = None) -> None:
        self.deadline = deadline
        self._stop.set()


class FakeApp:
    def __init__(self, names: list[str]) -> None:
        self._names = names

    @property
    def part_names(self) -> list[str]:
        return list(self._names)

    def build(self, settings: Any, only: Collection[str] | None = None) -> list[FakePart]:
        # Never the working directory (a test that sets no FAKE_DIR littered the checkout).
        folder = Path(_env("DIR") or tempfile.mkdtemp(prefix="consumerdedup-fake-"))
        return [FakePart(n, folder) for n in self._names if not only or n in only]

    def check(self, settings: Any, only: Collection[str] | None = None) -> list[Check]:
        names = [n for n in self._names if not only or n in only]
        bad = _env("SETUP_FAULT")
        return [
            Check(f"{n}: tables", FAIL if n == bad else "ok", "processed_events", "run init-db")
            for n in names
        ]


app = FakeApp(["orders", "payments", "relay"])
not_an_app = {"orders": 1}
