"""``consumerdedup run`` over a stand-in app (tests/worker/fake_service.py): the supervisor's
restarts, start-up deaths, setup faults, graceful and immediate stops, and its probes, each
read from real processes."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.run_command import Run, alive, wait_for

APP = "tests.worker.fake_service:app"
PARTS = ("orders", "payments", "relay")


@pytest.fixture
def start(tmp_path: Path) -> Iterator[object]:
    runs: list[Run] = []

    def starting(*args: str, **env: str) -> Run:
        run = Run([APP, *args], {"FAKE_DIR": str(tmp_path), **env})
        runs.append(run)
        return run

    yield starting
    for run in runs:
        run.stop()


def stopped_files(folder: Path, pid: int) -> set[str]:
    return {p.name.split(".")[0] for p in folder.glob(f"*.{pid}.stopped")}


def test_sigterm_stops_every_part_of_every_child_and_exits_0(start, tmp_path: Path) -> None:
    run = start("--workers", "2", "--health-port", "0")
    wait_for(lambda: run.status("/readyz") == 200, what="ready")
    pids = run.child_pids()
    assert len(pids) == 2
    _, body = run.get("/readyz")
    assert all(set(w["parts"]) == set(PARTS) for w in body["workers"])
    assert run.status("/livez") == 200
    run.signal(signal.SIGTERM)
    assert run.wait() == 0, run.stderr
    for pid in pids:
        assert stopped_files(tmp_path, pid) == set(PARTS)  # each run() returned after stop()
        assert not alive(pid)


def test_a_killed_child_is_restarted_and_readiness_comes_back(start, tmp_path: Path) -> None:
    run = start("--workers", "2", "--health-port", "0")
    wait_for(lambda: run.status("/readyz") == 200, what="ready")
    first, second = run.child_pids()
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: first not in run.child_pids() and len(run.child_pids()) == 2, what="restart")
    wait_for(lambda: run.status("/readyz") == 200, what="ready again")
    assert second in run.child_pids()
    _, body = run.get("/readyz")
    assert sorted(w["restarts"] for w in body["workers"]) == [0, 1]
    assert "died: worker" in run.stderr and "killed by SIGKILL" in run.stderr
    run.signal(signal.SIGTERM)
    assert run.wait() == 0, run.stderr


def test_a_child_that_dies_at_start_up_stops_the_worker_with_its_error(start) -> None:
    run = start("--workers", "2", FAKE_CRASH="payments")
    assert run.wait(120) == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("consumerdedup: error: worker ") and "died at start-up 3 times" in last
    assert "payments: RuntimeError: payments crashed at start" in last
    assert run.stderr.count("restarting in") >= 2  # restarted with backoff, then gave up


def test_a_setup_fault_stops_at_once_with_the_fix(start) -> None:
    run = start(FAKE_SETUP_FAULT="orders")
    assert run.wait(60) == 1
    last = run.stderr.strip().splitlines()[-1]
    assert (
        "consumerdedup: error: orders: ConfigurationError: table processed_events not found" in last
    )
    assert "run `consumerdedup init-db`" in last
    assert "restarting" not in run.stderr
    assert "Traceback" not in run.stderr


def test_an_outage_at_start_is_waited_out_and_readyz_says_so(start, tmp_path: Path) -> None:
    gate = tmp_path / "database-up"
    run = start("--health-port", "0", FAKE_OUTAGE_UNTIL=str(gate))

    def waiting() -> bool:
        status, body = run.get("/readyz")
        parts = body["workers"][0].get("parts") or {}
        return (
            status == 503 and bool(parts) and all(p["state"] == "waiting" for p in parts.values())
        )

    wait_for(waiting, what="parts waiting out the outage")
    _, body = run.get("/readyz")
    assert "ConnectionRefusedError" in body["workers"][0]["parts"]["orders"]["error"]
    assert run.status("/livez") == 200  # waiting for a database is not being stuck
    gate.write_text("up")
    wait_for(lambda: run.status("/readyz") == 200, what="ready once the database is up")
    assert run.process.poll() is None
    run.signal(signal.SIGTERM)
    assert run.wait() == 0, run.stderr


def test_a_hanging_handler_fails_livez(start, tmp_path: Path) -> None:
    run = start("--health-port", "0", "--liveness-timeout", "1", FAKE_HANG="payments")
    wait_for(lambda: run.status("/readyz") == 200, what="ready")
    assert run.status("/livez") == 200
    (tmp_path / "hang").write_text("now")
    wait_for(lambda: run.status("/livez") == 503, what="livez failing")
    _, body = run.get("/livez")
    assert "payments: its loop has not turned" in body["workers"][0]["why"]


def test_a_second_signal_exits_at_once(start, tmp_path: Path) -> None:
    run = start("--health-port", "0", "--shutdown-timeout", "60",
                FAKE_SLOW_STOP="orders", FAKE_SLOW_STOP_SECONDS="50")  # fmt: skip
    wait_for(lambda: run.status("/readyz") == 200, what="ready")
    [pid] = run.child_pids()
    run.signal(signal.SIGTERM)
    wait_for(lambda: stopped_files(tmp_path, pid) == {"payments", "relay"}, what="others stop")
    assert run.process.poll() is None  # orders' batch is still in flight
    run.signal(signal.SIGINT)
    assert run.wait(10) == 1
    assert "a second signal: stopping at once" in run.stderr
    wait_for(lambda: not alive(pid), 10, "the child gone")
    assert "orders" not in stopped_files(tmp_path, pid)


def test_only_runs_the_parts_named(start, tmp_path: Path) -> None:
    run = start("--health-port", "0", "--only", "relay", "--only", "orders")
    wait_for(lambda: run.status("/readyz") == 200, what="ready")
    _, body = run.get("/readyz")
    assert set(body["workers"][0]["parts"]) == {"relay", "orders"}
    run.signal(signal.SIGTERM)
    assert run.wait() == 0


def test_a_stop_past_the_shutdown_timeout_exits_1(start, tmp_path: Path) -> None:
    run = start("--health-port", "0", "--shutdown-timeout", "2",
                FAKE_SLOW_STOP="orders", FAKE_SLOW_STOP_SECONDS="50")  # fmt: skip
    wait_for(lambda: run.status("/readyz") == 200, what="ready")
    run.signal(signal.SIGTERM)
    assert run.wait(20) == 1
    assert "shutdown timeout" in run.stderr
