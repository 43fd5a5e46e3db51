"""``consumerdedup run --reload``: a change of the service's source replaces its worker."""

from __future__ import annotations

import signal
from pathlib import Path

from tests.support.run_command import ROOT, Run, wait_for

SERVICE = """from tests.worker.fake_service import FakeApp

app = FakeApp({parts!r})
"""


def test_a_change_of_the_source_restarts_the_worker(tmp_path: Path) -> None:
    source = tmp_path / "svc.py"
    source.write_text(SERVICE.format(parts=["orders"]))
    run = Run(["svc:app", "--reload", "--health-port", "0"],
              {"FAKE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}, cwd=tmp_path)  # fmt: skip
    try:
        wait_for(lambda: run.status("/readyz") == 200, what="ready")
        [first] = run.child_pids()
        source.write_text(SERVICE.format(parts=["orders", "payments"]))  # a new part

        def reloaded() -> bool:
            status, body = run.get("/readyz")
            worker = body["workers"][0]
            return status == 200 and set(worker.get("parts") or {}) == {"orders", "payments"}

        wait_for(reloaded, 60, "the new source running")
        assert run.child_pids() != [first]
        assert (tmp_path / f"orders.{first}.stopped").exists()  # the old one stopped in order
        run.signal(signal.SIGTERM)
        assert run.wait() == 0, run.stderr
    finally:
        run.stop()
