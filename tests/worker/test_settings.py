"""``consumerdedup run`` takes its settings from ``CONSUMERDEDUP_*`` variables and
``--env-file``: a flag beats the environment, which beats the file, which beats the default."""

from __future__ import annotations

import json
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.run_command import Run, wait_for

APP = "tests.worker.fake_service:app"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def runs() -> Iterator[list[Run]]:
    started: list[Run] = []
    yield started
    for run in started:
        run.stop()


def workers_of(run: Run) -> int:
    wait_for(lambda: run.status("/readyz") == 200, what="ready")
    return len(run.child_pids())


def test_the_environment_and_the_env_file(runs: list[Run], tmp_path: Path) -> None:
    env_file = tmp_path / "service.env"
    port = free_port()
    env_file.write_text(
        f"CONSUMERDEDUP_WORKERS=3\nCONSUMERDEDUP_HEALTH_PORT={port}\n"
        "CONSUMERDEDUP_LOG_FORMAT=json\nCONSUMERDEDUP_DATABASE_URL=postgresql://a:pw-in-file@db/x\n"
    )
    env = {"FAKE_DIR": str(tmp_path)}
    # The file alone: 3 workers on its port, JSON lines.
    run = Run([APP, "--env-file", str(env_file)], env)
    runs.append(run)
    assert run.port == port  # as its log says
    assert workers_of(run) == 3
    run.signal(signal.SIGTERM)
    assert run.wait() == 0, run.stderr
    lines = [json.loads(line) for line in run.stderr.splitlines()]
    assert any(line["message"].startswith("health probes on") for line in lines)
    assert "pw-in-file" not in run.stderr
    # The environment beats the file; a flag beats the environment.
    env_run = Run([APP, "--env-file", str(env_file), "--health-port", "0"],
                  {**env, "CONSUMERDEDUP_WORKERS": "2"})  # fmt: skip
    flag_run = Run([APP, "--env-file", str(env_file), "--health-port", "0", "--workers", "1"],
                   {**env, "CONSUMERDEDUP_WORKERS": "2"})  # fmt: skip
    runs += [env_run, flag_run]
    assert workers_of(env_run) == 2
    assert workers_of(flag_run) == 1
