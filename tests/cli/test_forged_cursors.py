"""Forged ``--after`` cursors on every command that takes one: exit 2 with "invalid cursor",
never a driver's error (issue 38, item 8). A cursor is base64url of a JSON array; these
are well-formed as such and hold what the key's columns cannot: an id past bigint, a NUL
byte, a lone surrogate, a key longer than the column, nesting deep enough to overflow."""

from __future__ import annotations

import argparse
import base64
import json
from datetime import UTC, datetime

import pytest

from consumerdedup import MAX_ID_LENGTH
from consumerdedup.cli.main import build_parser
from consumerdedup.failed import records
from consumerdedup.failed.records import FailedRecord
from consumerdedup.outbox import parked
from tests.conftest import Database
from tests.failed.test_records import add
from tests.support.cli import Cli, cli_fixture  # noqa: F401


def forged(content: object) -> str:
    raw = content if isinstance(content, str) else json.dumps(content)
    return base64.urlsafe_b64encode(raw.encode("utf-8", "surrogatepass")).decode().rstrip("=")


FORGED = {
    "past bigint": forged(["outbox", 2**63]),
    "below bigint": forged(["outbox", -(2**63) - 1]),
    "far past bigint": forged(["outbox", 10**40]),
    "NUL in the consumer": forged(["shop\x00", "order-1"]),
    "NUL in the id": forged(["failed", "shop", "order\x00"]),
    "key past the column": forged(["failed", "shop", "x" * 256]),
    "deep nesting": forged("[" * 100_000),
    "not base64": "%%%",
    "a float": forged(["outbox", 1.5]),
    "a bool": forged(["outbox", True]),
    "empty": "",
}
FORGED["lone surrogate"] = forged(json.loads('["failed", "\\ud800", "x"]'))


def commands_with_a_cursor() -> list[list[str]]:
    """Every command line of the parser that has ``--after`` (found, not listed by hand)."""
    found: list[list[str]] = []

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> None:
        if any("--after" in action.option_strings for action in parser._actions):
            found.append(path)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*path, name])

    walk(build_parser(), [])
    return found


def test_the_commands_with_a_cursor_are_known() -> None:
    assert sorted(commands_with_a_cursor()) == [["failed", "list"], ["outbox", "list"]]


@pytest.mark.parametrize("command", commands_with_a_cursor(), ids=" ".join)
def test_a_forged_cursor_is_a_usage_error(db: Database, cli: Cli, command: list[str]) -> None:
    add(db, "shop", ["order-1", "order-2"], error="KeyError: 'sku'")
    for name, cursor in FORGED.items():
        done = cli(db, *command, "--after", cursor)
        assert done.returncode == 2, (name, done.stderr)
        assert "invalid cursor" in done.stderr, (name, done.stderr)
        assert "database error" not in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("command", commands_with_a_cursor(), ids=" ".join)
def test_a_cursor_from_the_other_list_is_refused(
    db: Database, cli: Cli, command: list[str]
) -> None:
    other = forged(["outbox", 1]) if command[0] == "failed" else forged(["failed", "a", "b"])
    done = cli(db, *command, "--after", other)
    assert done.returncode == 2 and "invalid cursor" in done.stderr, done.stderr


def test_the_longest_keys_make_cursors_that_read_back() -> None:
    """A cursor of the longest ids (255 characters, each one JSON writes as two escapes)
    is one the check takes back."""
    longest = "\U0001f600" * MAX_ID_LENGTH
    record = FailedRecord(longest, longest, datetime.now(UTC), None)
    assert records.decode(records.encode(record)) == (longest, longest)
    assert parked.decode(parked.encode(2**63 - 1)) == 2**63 - 1
