"""The worker's log lines: ``--log-format json`` gives one JSON object a line with the
outcome fields log shippers index; ``--log-config`` a dictConfig of the operator's own."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from consumerdedup import Message, Outcome
from consumerdedup.app import logs
from consumerdedup.errors import ConfigurationError
from consumerdedup.observe import log_result
from consumerdedup.outcome import Result
from consumerdedup.reasons import mask_passwords


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = handlers, level


def json_lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_an_outcome_line_as_json_carries_its_fields(restore_logging, monkeypatch) -> None:
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    logs.configure("DEBUG", "json", scrub=mask_passwords)
    message = Message(id="pay-1", body=b"{}", source="payments")
    error = ValueError("amount missing; db at postgresql://u:hunter2@db/x")
    log_result("ledger", Result(message, Outcome.FAILED, error, 3))
    log_result("ledger", Result(message, Outcome.DUPLICATE, None, 1))
    failed, duplicate = json_lines(stream)
    assert failed["level"] == "ERROR" and failed["logger"] == "consumerdedup"
    assert {k: failed[k] for k in logs.OUTCOME_FIELDS} == {
        "consumer": "ledger", "message_id": "pay-1", "outcome": "failed",
        "source": "payments", "attempts": 3, "reason": failed["reason"],
    }  # fmt: skip
    assert "ValueError: amount missing" in str(failed["reason"])
    assert "hunter2" not in json.dumps(failed)  # reasons and tracebacks are scrubbed
    assert "Traceback" in str(failed["message"])
    assert duplicate["outcome"] == "duplicate" and "reason" not in duplicate
    assert str(failed["time"]).endswith("Z")


def test_a_log_config_file_replaces_the_handlers(restore_logging, tmp_path: Path) -> None:
    out = tmp_path / "service.log"
    config = {
        "version": 1,
        "formatters": {"json": {"()": "consumerdedup.app.logs.JsonFormatter"}},
        "handlers": {"file": {"class": "logging.FileHandler", "filename": str(out),
                              "formatter": "json"}},
        "root": {"level": "INFO", "handlers": ["file"]},
    }  # fmt: skip
    path = tmp_path / "logging.json"
    path.write_text(json.dumps(config))
    worker = logging.getLogger("consumerdedup.worker")  # exists before, as in the worker
    logs.configure(config_file=str(path))
    # dictConfig's default would have disabled it: the file does not name it.
    assert not worker.disabled
    worker.info("hello", extra={"part": "orders"})
    logging.getLogger().handlers[0].flush()
    [line] = [json.loads(x) for x in out.read_text().splitlines()]
    assert (line["message"], line["part"]) == ("hello", "orders")


def test_a_yaml_log_config_needs_pyyaml_or_says_so(tmp_path: Path) -> None:
    path = tmp_path / "logging.yaml"
    path.write_text("version: 1\nroot: {level: INFO}\n")
    try:
        import yaml  # type: ignore[import-untyped]  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigurationError, match="needs PyYAML"):
            logs.read_config(str(path))
    else:
        assert logs.read_config(str(path))["version"] == 1
