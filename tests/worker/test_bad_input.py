"""Bad input to ``consumerdedup run``: one line on stderr naming the thing and the fix,
exit 2, no traceback without --verbose; said before any child starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from consumerdedup.cli.main import main

APP = "tests.worker.fake_service:app"
SECRET = "s3cr3t-pw"


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    try:
        code = main(["run", *args])
    except SystemExit as exited:  # argparse's own usage errors
        code = int(exited.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("consumerdedup: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("CONSUMERDEDUP_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("CONSUMERDEDUP_DATABASE_URL", f"postgresql://app:{SECRET}@db/svc")


@pytest.mark.parametrize(
    ("target", "said"),
    [
        ("no_such_service:app", "no module named 'no_such_service'"),
        ("tests.worker.broken_service:app", "importing tests.worker.broken_service failed: "
         "RuntimeError: the service's module failed at import"),
        ("tests.worker.fake_service:nothing", "has no attribute 'nothing'; name the App"),
        ("tests.worker.fake_service:not_an_app", "is a dict, not a consumerdedup App"),
        ("tests.worker.fake_service", "expected MODULE:ATTRIBUTE"),
    ],
)  # fmt: skip
def test_an_app_path_that_names_no_app(capsys, target: str, said: str) -> None:
    code, out, err = run(capsys, target)
    assert code == 2
    assert said in one_line(err)
    assert out == ""


def test_verbose_shows_the_import_traceback(capsys) -> None:
    code, _, err = run(capsys, "tests.worker.broken_service:app", "--verbose")
    assert code == 2
    assert "Traceback" in err and "broken_service.py" in err


def test_a_setting_that_does_not_parse(capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONSUMERDEDUP_WORKERS", "abc")
    code, _, err = run(capsys, APP)
    assert code == 2
    assert "CONSUMERDEDUP_WORKERS='abc': expected an integer from 1 to 1024" in one_line(err)
    assert SECRET not in err


def test_a_setting_in_the_env_file_that_does_not_parse(capsys, tmp_path: Path) -> None:
    env_file = tmp_path / "service.env"
    env_file.write_text("CONSUMERDEDUP_SHUTDOWN_TIMEOUT=soon\n")
    code, _, err = run(capsys, APP, "--env-file", str(env_file))
    assert code == 2
    line = one_line(err)
    assert "CONSUMERDEDUP_SHUTDOWN_TIMEOUT='soon'" in line and str(env_file) in line


def test_a_flag_out_of_range_is_named_as_the_flag(capsys) -> None:
    code, _, err = run(capsys, APP, "--workers", "0")
    assert code == 2
    assert "--workers" in one_line(err)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--only", "nope"], "--only 'nope': the app has no part of that name; its parts: "
         "orders, payments, relay"),
        (["--reload", "--workers", "2"], "--reload runs one worker"),
        (["--env-file", "/nonexistent/service.env"], "/nonexistent/service.env"),
        (["--log-format", "xml"], "--log-format: expected one of 'text', 'json', got 'xml'"),
        (["--workers", "abc"], "argument --workers: invalid int value: 'abc'"),
    ],
)  # fmt: skip
def test_bad_flags(capsys, args: list[str], said: str) -> None:
    code, _, err = run(capsys, APP, *args)
    assert code == 2
    assert said in one_line(err)


def test_a_log_config_that_is_not_a_dict_config(capsys, tmp_path: Path) -> None:
    bad = tmp_path / "logging.json"
    bad.write_text(json.dumps({"handlers": {}}))
    code, _, err = run(capsys, APP, "--log-config", str(bad))
    assert code == 2
    assert f"--log-config {bad}: expected a logging dictConfig" in one_line(err)


def test_check_prints_each_check_and_exits_0_or_1(capsys, monkeypatch) -> None:
    code, out, err = run(capsys, APP, "--check")
    assert (code, err) == (0, "")
    assert out.count("ok ") == 3 and "3 check(s), 0 failing" in out
    monkeypatch.setenv("FAKE_SETUP_FAULT", "payments")
    code, out, _ = run(capsys, APP, "--check", "--only", "payments")
    assert code == 1
    assert "FAIL  payments: tables" in out and "fix: run init-db" in out
    assert "orders" not in out  # exactly what --only names
