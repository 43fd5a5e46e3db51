"""The worker's logging: a level, a format (text, or one JSON object a line), or a
``logging.config.dictConfig`` file of the operator's own.

The JSON lines carry what log shippers index: the time (UTC, ISO 8601), the level,
the logger, the message, the process, and the fields ``observe.log_result`` gives
every outcome line (consumer, message_id, outcome, source, attempts, reason).
A formatter of a few lines is all this needs; no JSON logging library is pulled in.
"""

from __future__ import annotations

import json
import logging
import logging.config
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError

FORMATS = ("text", "json")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
OUTCOME_FIELDS = ("consumer", "message_id", "outcome", "source", "attempts", "reason")
"""The ``extra`` fields of an outcome line (observe.log_result), and of a part's lines."""
WORKER_FIELDS = ("part", "worker")
TEXT_FORMAT = "%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s"
STAMP = "%Y-%m-%dT%H:%M:%S"

Scrub = Callable[[str], str]


def _utc(record: logging.LogRecord) -> str:
    return time.strftime(STAMP, time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


class TextFormatter(logging.Formatter):
    """A line of text, its time in UTC, its passwords masked by ``scrub``."""

    def __init__(self, scrub: Scrub | None = None) -> None:
        super().__init__(TEXT_FORMAT)
        self.scrub = scrub

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return _utc(record)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return self.scrub(text) if self.scrub else text


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, pid, the outcome fields when
    the record has them, and the traceback as ``exc``; passwords masked by ``scrub``."""

    def __init__(self, scrub: Scrub | None = None) -> None:
        super().__init__()
        self.scrub = scrub

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": _utc(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        for name in OUTCOME_FIELDS + WORKER_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        text = json.dumps(line, default=str, ensure_ascii=False)
        return self.scrub(text) if self.scrub else text


def configure(
    level: str = "INFO",
    log_format: str = "text",
    config_file: str | None = None,
    scrub: Scrub | None = None,
) -> None:
    """Replace the root logger's handlers: ``config_file`` (a dictConfig in JSON, or YAML
    when PyYAML is installed) if given, else one stderr handler in ``log_format`` at
    ``level``. A ConfigurationError names the option and what it expects."""
    if config_file:
        config = read_config(config_file)
        # dictConfig's default disables every logger that exists and the file does not name:
        # the worker has imported ours by then, so its outcome and error lines would vanish.
        # A file that wants that says "disable_existing_loggers": true.
        if isinstance(config, dict):
            config.setdefault("disable_existing_loggers", False)
        try:
            logging.config.dictConfig(config)
        except (ValueError, TypeError, AttributeError, ImportError) as error:
            raise ConfigurationError(f"--log-config {config_file}: {error}") from None
        return
    name = str(level).upper()
    if name not in LEVELS:
        raise ConfigurationError(f"log level {level!r}: expected one of {', '.join(LEVELS)}")
    if log_format not in FORMATS:
        raise ConfigurationError(f"log format {log_format!r}: expected one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(scrub) if log_format == "json" else TextFormatter(scrub))
    logging.basicConfig(level=name, handlers=[handler], force=True)
    # The broker clients say every reconnect attempt with a traceback: warnings only.
    for client in ("pika", "aiokafka"):
        logging.getLogger(client).setLevel(max(logging.WARNING, logging.getLevelName(name)))


def read_config(path: str) -> dict[str, Any]:
    """The dictConfig in ``path``: JSON, or YAML (.yaml/.yml) when PyYAML is installed."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigurationError(
            f"--log-config {path}: cannot read it ({error.strerror})"
        ) from None
    if file.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml  # type: ignore[import-untyped]
        except ImportError:
            raise ConfigurationError(
                f"--log-config {path}: a YAML file needs PyYAML (pip install pyyaml); "
                "or give the same dictConfig as JSON"
            ) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise ConfigurationError(f"--log-config {path}: not valid YAML ({error})") from None
    else:
        try:
            data = json.loads(text)
        except ValueError as error:
            raise ConfigurationError(f"--log-config {path}: not valid JSON ({error})") from None
    if not isinstance(data, dict) or data.get("version") != 1:
        raise ConfigurationError(
            f"--log-config {path}: expected a logging dictConfig (a mapping with version: 1)"
        )
    return data
