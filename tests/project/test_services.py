"""In CI no skip passes silently: tests/conftest.py turns every skip into a failure there.

Run in a pytest of its own (a subprocess) on a few tests that skip in every way pytest
offers, once as a developer would and once as CI does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SKIPPING = """
import pytest

from tests.support import services


def test_skipped_by_a_call():
    pytest.skip("by a call")


@pytest.mark.skip(reason="by a marker")
def test_skipped_by_a_marker():
    pass


def test_skipped_through_the_services_helper():
    services.unavailable("by the helper: no such broker")


def test_skipped_by_importorskip():
    pytest.importorskip("consumerdedup_no_such_module")


@pytest.mark.xfail(reason="an expected failure is not a skip", strict=True)
def test_expected_to_fail():
    assert False


def test_passes():
    pass
"""

SKIPPED_MODULE = """
import pytest

pytest.skip("by the module", allow_module_level=True)
"""

REASONS = ["by a call", "by a marker", "by the helper: no such broker", "No module named"]


def run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_skipping.py").write_text(SKIPPING)
    (tmp_path / "test_skipped_module.py").write_text(SKIPPED_MODULE)
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nasyncio_default_fixture_loop_scope = function\n"
    )
    clean = {
        k: v for k, v in os.environ.items() if k not in ("CI", "CONSUMERDEDUP_REQUIRE_SERVICES")
    }
    command = [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider"]
    # A module skipped at import fails collection in CI; go on to the other module.
    command += [
        "--continue-on-collection-errors",
        "-rA",
        "-c",
        str(tmp_path / "pytest.ini"),
        "--rootdir",
        str(tmp_path),
    ]
    return subprocess.run(
        [*command, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,  # so that tests.conftest imports
        env={**clean, **env},
        timeout=120,
    )


def summary(done: subprocess.CompletedProcess[str]) -> str:
    return done.stdout.strip().splitlines()[-1]


def test_locally_a_skip_is_a_skip(tmp_path: Path) -> None:
    done = run(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed, 5 skipped, 1 xfailed" in summary(done), done.stdout
    assert "skipped in CI" not in done.stdout


@pytest.mark.parametrize(
    "env", [{"CI": "true"}, {"CONSUMERDEDUP_REQUIRE_SERVICES": "1"}], ids=["CI", "REQUIRE"]
)
def test_in_ci_every_kind_of_skip_is_a_failure(tmp_path: Path, env: dict[str, str]) -> None:
    done = run(tmp_path, **env)
    assert done.returncode == 1, done.stdout + done.stderr
    last = summary(done)
    # A marker skips in setup and a module at collection: those are reported as errors.
    assert "3 failed, 1 passed, 1 xfailed, 2 errors" in last, done.stdout
    assert "skipped" not in last
    for reason in [*REASONS, "by the module"]:
        assert reason in done.stdout, (reason, done.stdout)
    assert done.stdout.count("skipped in CI") >= 4, done.stdout
