"""Every failed attempt is logged as it happens (issue 38 item 6).

Before: nothing was logged until the batch ended (98 s in the trial with a batch
of 100), then one line per final Result. Now each failed try is a WARNING with
the message id, attempt n/N, the exception type and a scrubbed reason; the
traceback comes once per distinct error (type and place), not per attempt.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy.exc

from consumerdedup import AsyncDeduplicator, Deduplicator, Message, Outcome, Result, RetryPolicy
from consumerdedup.dedup.attempt_log import TRACEBACKS_SEEN, AttemptLog
from tests.conftest import Database

FAST = RetryPolicy(attempts=3, initial_delay=timedelta(0), max_delay=timedelta(0))
SECRET = "".join(["hun", "ter2"])  # built, so that no source line in a traceback shows it


def attempt_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name == "consumerdedup.attempts"
    ]


def process(db: Database, kind: str, messages: list[Message], fail: Any) -> list[Result]:
    """``messages`` in one process_batch; ``fail(message)`` runs in the handler."""
    if kind == "sync":
        dedup = Deduplicator(db.engine, "c", tables=db.tables, retry=FAST)
        return dedup.handler(lambda message, session: fail(message)).process_batch(messages)

    async def run() -> list[Result]:
        engine = db.async_engine()
        try:
            adedup = AsyncDeduplicator(engine, "c", tables=db.tables, retry=FAST)

            @adedup.handler
            async def handle(message: Message, session: Any) -> None:
                fail(message)

            return await handle.process_batch(messages)
        finally:
            await engine.dispose()

    return asyncio.run(run())


drivers = pytest.mark.parametrize("kind", ["sync", "async"])


@drivers
def test_each_failed_attempt_is_a_warning_as_it_happens(
    sqlite_db: Database, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="consumerdedup")
    seen_at_call: list[tuple[str, int]] = []

    def fail(message: Message) -> None:
        logged = [r for r in attempt_lines(caplog) if repr(message.id) in r.getMessage()]
        seen_at_call.append((message.id, len(logged)))
        raise KeyError("customer_id")

    messages = [Message(id=f"m{n}", body=b"{}") for n in range(3)]
    results = process(sqlite_db, kind, messages, fail)
    assert [r.outcome for r in results] == [Outcome.FAILED] * 3
    # At its k-th call, a message's k-1 failed attempts were already logged: as they happened.
    for message in messages:
        assert [n for i, n in seen_at_call if i == message.id] == [0, 1, 2]
    lines = attempt_lines(caplog)
    assert len(lines) == 9
    for message in messages:
        mine = [r.getMessage() for r in lines if f"message_id={message.id!r}" in r.getMessage()]
        assert [line.split(" attempt ")[1].split(" ")[0] for line in mine] == ["1/3", "2/3", "3/3"]
        assert all("error=KeyError" in line and "customer_id" in line for line in mine)
        assert mine[-1].endswith("FAILED") or "; FAILED" in mine[-1]
        assert all("tried again" in line for line in mine[:-1])
    # One error, one place: its traceback once, on the very first line.
    with_trace = [r for r in lines if "Traceback (most recent call last)" in r.getMessage()]
    assert with_trace == [lines[0]]


@drivers
def test_a_traceback_per_distinct_error_and_no_secret_in_any_line(
    sqlite_db: Database, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="consumerdedup")
    url = f"postgresql://app:{SECRET}@db.internal/shop"

    def fail(message: Message) -> None:
        if message.id.startswith("db"):
            raise sqlalchemy.exc.IntegrityError(
                "INSERT INTO cards (number) VALUES (%(number)s)",
                {"number": SECRET},
                Exception("duplicate key value violates unique constraint"),
            )
        raise ConnectionRefusedError(f"cannot reach {url}") from None

    messages = [Message(id=i, body=b"{}") for i in ("db1", "net1", "db2", "net2")]
    process(sqlite_db, kind, messages, fail)
    lines = attempt_lines(caplog)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert SECRET not in text, text
    assert "IntegrityError" in text and "ConnectionRefusedError" in text
    traced = [r.getMessage() for r in lines if "Traceback (most recent" in r.getMessage()]
    assert len(traced) == 2, traced  # one per error type and place, not per message or try
    assert sum("IntegrityError" in t.split("\n")[0] for t in traced) == 1


def test_the_tracebacks_remembered_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="consumerdedup")
    log = AttemptLog("c", 1)
    errors: list[BaseException] = []
    for n in range(TRACEBACKS_SEEN + 5):
        kind = type(f"Error{n}", (Exception,), {})
        try:
            raise kind("x")
        except Exception as exc:
            errors.append(exc)
            log.failed([f"m{n}"], 1, exc, "FAILED")
    log.failed(["again"], 1, errors[0], "FAILED")  # forgotten long ago: traced again
    assert "Traceback" in caplog.records[-1].getMessage()
    log.failed(["again"], 1, errors[-1], "FAILED")  # recent: not again
    assert "Traceback" not in caplog.records[-1].getMessage()


def test_an_attempts_reason_is_short(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="consumerdedup")
    AttemptLog("c", 4).failed(["m"], 1, ValueError("x" * 2000), "tried again")
    line = caplog.records[-1].getMessage().split("\n")[0]
    assert "reason=ValueError: xxx" in line and "..." in line and len(line) < 500
