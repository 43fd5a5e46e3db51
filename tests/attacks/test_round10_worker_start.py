"""Round 10, fresh eyes on issue 32 through `consumerdedup run`: a stop signal that comes
while a worker child is still starting.

The child installs its SIGTERM handler first thing in main(), but a child spends its first
half second (more on a loaded host or a cold disk) importing the interpreter's site and
consumerdedup before main() runs. A SIGTERM then (a rolling update that stops a pod just
started, `systemctl stop` right after a start, a supervisor stop while a crashed child was
being restarted) met the default action: the child died "killed by SIGTERM" and the
supervisor, taking that for a failure, exited 1 instead of the documented 0. Under
--reload the same death left the worker with no child until the next change. Seen
failing before the fix (exit 1, "worker 0 killed by SIGTERM").

The child's start is held where it is still importing by a sitecustomize of the test's
(the interpreter runs it before any of consumerdedup is imported), until a stop signal is
pending or it was killed by one: no timing, whichever way the code behaves.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Database
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401
from tests.support.run_command import Run, wait_for

APP = "tests.worker.ledger_service:app"

HOLD = """
import os, signal, time
_folder = os.environ.get("ROUND10_HOLD_DIR")
if _folder and os.environ.get("CONSUMERDEDUP_WORKER_SPEC"):  # a worker child, still importing
    open(os.path.join(_folder, "held.%d" % os.getpid()), "w").close()
    _until = time.monotonic() + 60
    while signal.SIGTERM not in signal.sigpending() and time.monotonic() < _until:
        time.sleep(0.01)
"""


@pytest.fixture
def runs() -> Iterator[list[Run]]:
    started: list[Run] = []
    yield started
    for run in started:
        run.stop()


def test_sigterm_while_the_child_is_still_importing_is_a_clean_stop(
    pg: Database, rabbit: Broker, tmp_path: Path, runs: list[Run]
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HOLD)
    held = tmp_path / "held"
    held.mkdir()
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    run = Run(
        [APP],
        {
            "CONSUMERDEDUP_DATABASE_URL": pg.url,
            "CONSUMERDEDUP_RABBITMQ_URL": rabbit.url,
            "LEDGER_QUEUE": rabbit.queue("ledger"),
            "LEDGER_SCHEMA": str(pg.schema),
            "ROUND10_HOLD_DIR": str(held),
            "PYTHONPATH": path,
        },
    )
    runs.append(run)
    [marker] = wait_for(lambda: list(held.glob("held.*")), 60, "the child held at its start")
    child = int(marker.name.split(".")[1])
    run.signal(signal.SIGTERM)
    code = run.wait(60)
    assert "killed by SIGTERM" not in run.stderr, run.stderr
    assert code == 0, run.stderr
    assert "worker 0 stopping (signal)" in run.stderr
    assert str(child) in run.stderr  # the held child went on to stop itself, cleanly


def test_sigterm_to_the_supervisor_before_any_child_reported_exits_0_with_workers(
    pg: Database, rabbit: Broker, tmp_path: Path, runs: list[Run]
) -> None:
    """Two children, both held at their start: one signal stops both cleanly."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HOLD)
    held = tmp_path / "held"
    held.mkdir()
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    run = Run(
        [APP, "--workers", "2"],
        {
            "CONSUMERDEDUP_DATABASE_URL": pg.url,
            "CONSUMERDEDUP_RABBITMQ_URL": rabbit.url,
            "LEDGER_QUEUE": rabbit.queue(f"ledger-{uuid.uuid4().hex[:6]}"),
            "LEDGER_SCHEMA": str(pg.schema),
            "ROUND10_HOLD_DIR": str(held),
            "PYTHONPATH": path,
        },
    )
    runs.append(run)
    wait_for(lambda: len(list(held.glob("held.*"))) == 2, 60, "both children held")
    run.signal(signal.SIGTERM)
    code = run.wait(60)
    assert "killed by SIGTERM" not in run.stderr, run.stderr
    assert code == 0, run.stderr
    assert run.stderr.count("stopping (signal)") == 2, run.stderr
