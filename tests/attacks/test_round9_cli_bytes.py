"""Round 9: command-line arguments that are not valid text (bytes the locale cannot
decode, which reach Python as lone surrogates) are a usage error on every command: exit 2,
one line naming the argument, never its value (it may be a URL with a password).

Seen failing before the fix: ``failed list --consumer``, ``failed show``, ``forget`` and
``outbox show`` given such a byte ended with exit 1 and "UnicodeEncodeError: 'utf-8'
codec can't encode character '\\udcff'"; ``failed replay --dead-letter-queue`` tried to
connect first.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import Database
from tests.support.cli import database_options

BAD = os.fsdecode(b"a\xff")  # what Python makes of the byte 0xff in argv: 'a\udcff'
SECRET = "pw-r9-secret"
CLOSED = "amqp://guest:guest@127.0.0.1:1/"

COMMANDS = [
    ["failed", "list", "--consumer", BAD],
    ["failed", "list", "--reason", BAD],
    ["failed", "show", "--consumer", "orders", BAD],
    ["failed", "forget", "--consumer", "orders", BAD, "--yes"],
    ["forget", "--consumer", BAD, "order-1", "--yes"],
    ["outbox", "show", BAD],
    ["failed", "replay", "--rabbitmq", CLOSED, "--dead-letter-queue", BAD, "--dry-run"],
    ["relay", "--rabbitmq", f"amqp://guest:{SECRET}{BAD}@127.0.0.1:1/", "--once"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_an_argument_that_is_not_text_is_a_usage_error(pg: Database, command: list[str]) -> None:
    argv = [os.fsencode(a) for a in [sys.executable, "-m", "consumerdedup", *command]]
    argv += [os.fsencode(a) for a in database_options(pg)]
    done = subprocess.run(argv, capture_output=True, timeout=120, check=False)
    stderr = done.stderr.decode("utf-8", "replace")
    assert done.returncode == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "not valid text" in lines[0], stderr
    assert "Traceback" not in stderr and SECRET not in stderr and "UnicodeEncodeError" not in stderr
