"""Round 10, fresh eyes on issue 32's settings through `consumerdedup run`: hostile values
from the environment and the env file are one line naming the thing, exit 2.

Seen failing before the fixes:
- an env file that is not UTF-8 (a Latin-1 editor's é) ended with exit 1 and a bare
  "UnicodeDecodeError: 'utf-8' codec can't decode byte 0xe9 in position 26", naming
  neither the file nor the fix;
- CONSUMERDEDUP_WORKERS=100000000000000000000 (or --workers 2**62) was taken, and the
  supervisor hung making a slot for each worker before it started the first one.
The other hostile values tried here were already refused or read as documented; they
stay as regression cases.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from consumerdedup.cli.main import main

APP = "tests.worker.fake_service:app"
SECRET = "s3cr3t-pw"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    for name in list(os.environ):
        if name.startswith("CONSUMERDEDUP_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("CONSUMERDEDUP_DATABASE_URL", f"postgresql://app:{SECRET}@db/svc")
    yield monkeypatch


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    try:
        code = main(["run", *args])
    except SystemExit as exited:
        code = int(exited.code or 0)
    out, err = capsys.readouterr()
    assert SECRET not in out + err
    return code, err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("consumerdedup: error: "), err
    return lines[0]


def test_an_env_file_that_is_not_utf8_is_named_with_the_fix(capsys, tmp_path: Path) -> None:
    env_file = tmp_path / "service.env"
    env_file.write_bytes(b"CONSUMERDEDUP_WORKERS=2\nGREETING=caf\xe9\n")
    code, err = run(capsys, APP, "--env-file", str(env_file), "--check")
    line = one_line(err)
    assert code == 2, err
    assert str(env_file) in line and "UTF-8" in line and "0xe9" in line


def test_an_env_file_with_a_bom_and_a_key_twice_reads_as_dotenv_does(tmp_path: Path) -> None:
    from consumerdedup.app import Settings

    env_file = tmp_path / "service.env"
    env_file.write_bytes(
        b"\xef\xbb\xbfCONSUMERDEDUP_WORKERS=4\nCONSUMERDEDUP_SHUTDOWN_TIMEOUT=9\n"
        b"CONSUMERDEDUP_SHUTDOWN_TIMEOUT=12\n"
    )
    settings = Settings.load(env_file)
    assert settings.workers == 4  # the BOM does not hide the first key
    assert settings.shutdown_timeout == 12.0  # the last one, as python-dotenv and the shell


def _run_bounded(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`consumerdedup run` in a process of its own, its memory bounded: on the old code the
    supervisor hung making a slot per worker, and grew until this bound stopped it."""

    def bounded() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2**30, 2**30))

    return subprocess.run(
        [sys.executable, "-m", "consumerdedup", "run", APP, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("CONSUMERDEDUP_")},
            **env,
        },
        preexec_fn=bounded,
    )


def test_too_many_workers_from_the_environment_is_refused() -> None:
    value = "100000000000000000000"
    done = _run_bounded(CONSUMERDEDUP_WORKERS=value)
    assert done.returncode == 2, done.stderr
    said = f"CONSUMERDEDUP_WORKERS='{value}': expected an integer from 1 to 1024"
    assert said in one_line(done.stderr)


def test_the_bound_on_workers_is_1024(clean_env: pytest.MonkeyPatch) -> None:
    # Read, not run: on the old code 1025 was taken and started 1025 children.
    from consumerdedup import ConfigurationError
    from consumerdedup.app import Settings

    clean_env.setenv("CONSUMERDEDUP_WORKERS", "1025")
    with pytest.raises(ConfigurationError, match="expected an integer from 1 to 1024"):
        Settings.load()
    with pytest.raises(ConfigurationError, match="workers"):
        Settings.load(workers=1025)
    clean_env.setenv("CONSUMERDEDUP_WORKERS", "1024")
    assert Settings.load().workers == 1024


def test_too_many_workers_on_the_command_line_is_refused_before_any_child() -> None:
    done = _run_bounded("--workers", str(2**62))
    assert done.returncode == 2, done.stderr
    assert "--workers" in one_line(done.stderr) and "1024" in done.stderr


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("WORKERS", "no"),
        ("WORKERS", ""),
        ("WORKERS", "-1"),
        ("WORKERS", "1e309"),
        ("WORKERS", "nan"),
        ("SHUTDOWN_TIMEOUT", "nan"),
        ("SHUTDOWN_TIMEOUT", "1e309"),
        ("SHUTDOWN_TIMEOUT", "-1"),
        ("SHUTDOWN_TIMEOUT", "5s"),
        ("LIVENESS_TIMEOUT", "inf"),
        ("HEALTH_PORT", "65536"),
        ("LOG_FORMAT", "JSON"),
    ],
)
def test_hostile_values_are_one_line_exit_2(
    capsys, clean_env: pytest.MonkeyPatch, name: str, value: str
) -> None:
    clean_env.setenv(f"CONSUMERDEDUP_{name}", value)
    code, err = run(capsys, APP)
    assert code == 2, err
    assert f"CONSUMERDEDUP_{name}={value!r}" in one_line(err)


def test_a_rabbitmq_url_that_does_not_parse_never_shows_its_password(
    capsys, clean_env: pytest.MonkeyPatch
) -> None:
    clean_env.setenv("CONSUMERDEDUP_RABBITMQ_URL", f"amqp://app:{SECRET}@mq:notaport/%2F")
    code, _ = run(capsys, "tests.worker.ledger_service:app", "--check")
    assert code == 1  # a FAIL line for the consumer's broker; the password never printed


def test_a_liveness_timeout_shorter_than_the_reports_is_refused(
    capsys, clean_env: pytest.MonkeyPatch
) -> None:
    # Seen failing before the fix: 0.2 was taken, and /livez failed while every loop turned
    # (a child reports twice a second), so the orchestrator restarted healthy pods.
    code, err = run(capsys, APP, "--liveness-timeout", "0.2", "--check")
    assert code == 2, err
    assert "--liveness-timeout" in one_line(err) and ">= 1" in err
    clean_env.setenv("CONSUMERDEDUP_LIVENESS_TIMEOUT", "0.5")
    code, err = run(capsys, APP, "--check")
    assert code == 2, err
    assert "CONSUMERDEDUP_LIVENESS_TIMEOUT='0.5': expected a number of seconds >= 1" in err
    clean_env.setenv("CONSUMERDEDUP_LIVENESS_TIMEOUT", "1")
    code, err = run(capsys, APP, "--check")
    assert code == 0, err
