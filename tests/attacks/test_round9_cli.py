"""Round 9, fresh eyes on the CLI's new filters (issue 38 items 8 and 10): a time that
parses but lies outside datetime's range in UTC is a usage error (exit 2, one line).

Seen failing before the fix: ``failed list --since 9999-12-31T23:59:59-23:00`` (and
``0001-01-01T00:00:00+01:00``, ``--since 800000d``) ended with exit 1 and
"OverflowError: date value out of range" from the query, as a runtime failure would.
"""

from __future__ import annotations

import argparse

import pytest

from consumerdedup.cli.main import build_parser
from tests.conftest import Database
from tests.support.cli import Cli, cli_fixture  # noqa: F401

OUT_OF_RANGE = [
    "9999-12-31T23:59:59-23:00",  # year 10000 in UTC
    "0001-01-01T00:00:00+01:00",  # year 0 in UTC
    "800000d",  # 800,000 days ago: before year 1
]
CLOSED = "amqp://guest:guest@127.0.0.1:1/"
"""A broker address nothing listens on: a usage error must come before any connection."""


def commands_with_a_time_filter() -> list[list[str]]:
    """Every command line of the parser that has ``--since`` (found, not listed by hand)."""
    found: list[list[str]] = []

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> None:
        if any("--since" in action.option_strings for action in parser._actions):
            found.append(path)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*path, name])

    walk(build_parser(), [])
    return found


def _extra(command: list[str]) -> list[str]:
    if command == ["failed", "replay"]:
        return ["--rabbitmq", CLOSED, "--dead-letter-queue", "orders.dlq", "--dry-run"]
    if command == ["failed", "forget"]:
        return ["--consumer", "orders", "--dry-run"]
    return []


def test_the_commands_with_a_time_filter_are_known() -> None:
    assert sorted(commands_with_a_time_filter()) == [
        ["failed", "forget"],
        ["failed", "list"],
        ["failed", "replay"],
    ]


@pytest.mark.parametrize("command", commands_with_a_time_filter(), ids=" ".join)
@pytest.mark.parametrize("option", ["--since", "--until"])
@pytest.mark.parametrize("when", OUT_OF_RANGE)
def test_a_time_out_of_range_is_a_usage_error(
    pg: Database, cli: Cli, command: list[str], option: str, when: str
) -> None:
    done = cli(pg, *command, *_extra(command), f"{option}={when}")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "out of range" in lines[0] and option in lines[0], done.stderr
    assert "OverflowError" not in done.stderr and "Traceback" not in done.stderr


def test_a_time_with_an_offset_still_filters(pg: Database, cli: Cli) -> None:
    done = cli(pg, "failed", "list", "--since=2026-01-01T00:00:00+02:00")
    assert done.returncode == 0 and "no FAILED records" in done.stdout, done.stderr


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--max-failed", str(10**23)], "--max-failed"),
        (["--max-attempts", "0"], "--max-attempts"),
        (["--relays", str(10**20)], "--relays"),
        (["--relay-batch-size", str(10**23)], "--relay-batch-size"),
    ],
)
def test_doctor_refuses_numbers_it_cannot_use_as_usage_errors(
    pg: Database, cli: Cli, args: list[str], said: str
) -> None:
    """Seen failing before the fix: --max-attempts 0 (every row "parked") and --relays
    10**20 were taken (exit 0); --max-failed 10**23 ended with exit 1, as a failing check."""
    done = cli(pg, "doctor", *args)
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0] and "Settings." not in lines[0], done.stderr


def test_doctor_settings_take_a_consumer_as_one_name() -> None:
    """consumerdedup.doctor.Settings, checked where given (Invariant 10): a str is one
    consumer, never a list of its characters; a wrong type is a ConfigurationError."""
    from datetime import timedelta

    from consumerdedup import ConfigurationError
    from consumerdedup.doctor import Settings

    assert Settings(consumers="payments").consumers == ("payments",)
    for wrong in (
        {"windows": "payments=7d"},
        {"outbox_max_age": 300},
        {"relays": True},
        {"retention": timedelta(0)},
        {"max_attempts": "10"},
    ):
        with pytest.raises(ConfigurationError, match="Settings"):
            Settings(**wrong)  # type: ignore[arg-type]


CLOSED_KAFKA = "127.0.0.1:1"


@pytest.mark.parametrize(
    "args",
    [
        ["--kafka", CLOSED_KAFKA, "--topic", ".."],
        ["--kafka", CLOSED_KAFKA, "--dead-letter-topic", "orders dlq"],
        ["--kafka", CLOSED_KAFKA, "--topic", "orders", "--to", "a%b"],
        ["--rabbitmq", CLOSED, "--dead-letter-queue", "q" * 256],
        ["--rabbitmq", CLOSED, "--queue", "orders", "--to", " "],
    ],
    ids=["topic ..", "dlq topic with a space", "--to %", "dlq of 256 bytes", "--to blank"],
)
def test_failed_replay_refuses_names_the_broker_cannot_take_before_connecting(
    pg: Database, cli: Cli, args: list[str]
) -> None:
    """Seen failing before the fix: each tried the (closed) broker first and ended with
    exit 1 and a connection error (Kafka: plus aiokafka's 'Unclosed AIOKafkaConsumer')."""
    done = cli(pg, "failed", "replay", *args, "--dry-run")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "expected a" in lines[0], done.stderr
