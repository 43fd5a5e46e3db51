"""What a consumer tells the world: outcome counts, observers, log lines, results."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from consumerdedup import (
    DedupHandler,
    Deduplicator,
    Message,
    Outcome,
    OutcomeCounts,
    PermanentError,
    Result,
    RetryLater,
    RetryPolicy,
)
from tests.conftest import Database

TWO_TRIES = RetryPolicy(attempts=2, initial_delay=timedelta(0), max_delay=timedelta(0))


def msg(mid: str, mode: str = "ok") -> Message:
    return Message(id=mid, body=json.dumps({"mode": mode}).encode(), source="payments")


def wrap(
    db: Database,
    observers: Iterable[Callable[[Result], None]] = (),
    consumer: str = "ledger",
    new_ledger: bool = True,
) -> DedupHandler:
    """A handler that writes a ledger row; the body's mode can refuse or delay it."""
    ledger = db.create_ledger() if new_ledger else db.name("ledger")
    tries: dict[str, int] = {}
    dedup = Deduplicator(
        db.engine, consumer=consumer, tables=db.tables, retry=TWO_TRIES, observers=observers
    )

    @dedup.handler
    def handle(message: Message, session: Session) -> None:
        tries[message.id] = tries.get(message.id, 0) + 1
        mode = message.json()["mode"]
        if mode == "refuse":
            raise PermanentError("refused by the handler")
        if mode == "busy":
            raise RetryLater("downstream busy")
        if mode == "flaky" and tries[message.id] == 1:
            raise RetryLater("first try refused")
        session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', 1, :m)"),
            {"m": message.id},
        )

    return handle


# OutcomeCounts


def test_counts_count_each_outcome(db: Database) -> None:
    handle = wrap(db)
    outcomes = [
        handle(msg("p-1")),
        handle(msg("p-1")),
        handle(msg("p-1")),
        handle(msg("bad", "refuse")),
        handle(msg("later", "busy")),
        handle(msg("p-2")),
    ]
    assert outcomes == [
        Outcome.PROCESSED,
        Outcome.DUPLICATE,
        Outcome.DUPLICATE,
        Outcome.FAILED,
        Outcome.RETRY,
        Outcome.PROCESSED,
    ]
    counts = handle.dedup.counts
    assert counts[Outcome.PROCESSED] == 2
    assert counts[Outcome.DUPLICATE] == 2
    assert counts[Outcome.FAILED] == 1
    assert counts[Outcome.RETRY] == 1


def test_counts_include_every_message_of_a_batch(db: Database) -> None:
    handle = wrap(db)
    handle.batch([msg("p-1"), msg("p-1"), msg("bad", "refuse"), msg("p-2"), msg("", "ok")])
    assert handle.dedup.counts.snapshot() == {
        Outcome.PROCESSED: 2,
        Outcome.DUPLICATE: 1,
        Outcome.FAILED: 2,  # the refused one and the empty key
        Outcome.RETRY: 0,
    }


def test_snapshot_is_a_copy_with_every_outcome(db: Database) -> None:
    handle = wrap(db)
    empty = handle.dedup.counts.snapshot()
    assert empty == dict.fromkeys(Outcome, 0)
    handle(msg("p-1"))
    after = handle.dedup.counts.snapshot()
    assert empty[Outcome.PROCESSED] == 0  # an earlier snapshot does not move
    assert after[Outcome.PROCESSED] == 1
    assert "processed=1" in repr(handle.dedup.counts)
    assert "duplicate=0" in repr(handle.dedup.counts)


def test_counts_belong_to_their_deduplicator(db: Database) -> None:
    first = wrap(db, consumer="ledger")
    second = wrap(db, consumer="audit", new_ledger=False)
    first(msg("p-1"))
    second(msg("p-1"))
    second(msg("p-1"))
    assert first.dedup.counts[Outcome.DUPLICATE] == 0
    assert second.dedup.counts[Outcome.DUPLICATE] == 1
    assert second.dedup.counts[Outcome.PROCESSED] == 1


def test_outcome_counts_are_thread_safe() -> None:
    counts = OutcomeCounts()

    def add_many() -> None:
        for _ in range(5000):
            counts.add(Outcome.PROCESSED)
            counts.add(Outcome.RETRY)

    threads = [threading.Thread(target=add_many) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert counts.snapshot() == {
        Outcome.PROCESSED: 40000,
        Outcome.DUPLICATE: 0,
        Outcome.FAILED: 0,
        Outcome.RETRY: 40000,
    }


# Observers


def test_observers_receive_every_result(db: Database) -> None:
    first: list[Result] = []
    second: list[Result] = []
    handle = wrap(db, observers=[first.append, second.append])
    returned = [handle.process(msg("p-1"))]
    returned += handle.process_batch(
        # wobbly before later: once later's RetryLater has used up its attempts, the same
        # failure again would give the rest of the batch back untried (the batch's time bound).
        [msg("p-1"), msg("bad", "refuse"), msg("wobbly", "flaky"), msg("later", "busy")]
    )

    assert first == returned
    assert second == returned
    assert all(seen is result for seen, result in zip(first, returned, strict=True))
    assert [(r.message.id, r.outcome, r.attempts) for r in first] == [
        ("p-1", Outcome.PROCESSED, 1),
        ("p-1", Outcome.DUPLICATE, 1),
        ("bad", Outcome.FAILED, 1),
        ("wobbly", Outcome.PROCESSED, 2),
        ("later", Outcome.RETRY, 2),
    ]
    assert first[0].message == msg("p-1")
    assert first[0].error is None and first[1].error is None and first[3].error is None
    assert isinstance(first[2].error, PermanentError)
    assert isinstance(first[4].error, RetryLater)


def test_observers_see_the_outcome_after_it_is_settled(db: Database) -> None:
    """An observer told PROCESSED can rely on the dedup record being committed."""
    committed: list[bool] = []
    pe = db.tables.processed_events

    def check(result: Result) -> None:
        with db.engine.connect() as conn:
            query = select(pe.c.message_id).where(pe.c.message_id == result.message.id)
            committed.append(conn.execute(query).first() is not None)

    handle = wrap(db, observers=[check])
    handle(msg("p-1"))
    handle(msg("later", "busy"))
    assert committed == [True, False]


# Log lines


def ours(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name == "consumerdedup"]


def test_log_lines_name_consumer_message_id_and_outcome_at_matching_levels(
    db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="consumerdedup")
    handle = wrap(db)
    handle(msg("p-1"))
    handle(msg("p-1"))
    handle(msg("later", "busy"))
    handle(msg("bad", "refuse"))

    records = ours(caplog)
    assert [(r.levelno, getattr(r, "outcome", None)) for r in records] == [
        (logging.DEBUG, "processed"),
        (logging.DEBUG, "duplicate"),  # a redelivery storm is no news: INFO by a setting
        (logging.WARNING, "retry"),
        (logging.ERROR, "failed"),
    ]
    expected_keys = ["p-1", "p-1", "later", "bad"]
    for record, key in zip(records, expected_keys, strict=True):
        line = record.getMessage()
        assert "consumer=ledger" in line
        assert f"message_id={key!r}" in line
        assert f"outcome={record.__dict__['outcome']}" in line
        assert record.__dict__["consumer"] == "ledger"
        assert record.__dict__["message_id"] == key
    retry_line, failed_line = records[2].getMessage(), records[3].getMessage()
    assert "reason=RetryLater: downstream busy" in retry_line
    assert "attempts=2" in retry_line
    assert "reason=PermanentError: refused by the handler" in failed_line
    assert "reason=" not in records[0].getMessage()


def test_duplicates_at_info_by_the_setting(
    sqlite_db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    from consumerdedup.observe import log_duplicates_at

    caplog.set_level(logging.INFO, logger="consumerdedup")
    handle = wrap(sqlite_db)
    handle(msg("p-1"))
    handle(msg("p-1"))
    assert ours(caplog) == []  # DEBUG by default
    log_duplicates_at(logging.INFO)
    try:
        handle(msg("p-1"))
    finally:
        log_duplicates_at(logging.DEBUG)
    assert [(r.levelno, r.__dict__["outcome"]) for r in ours(caplog)] == [
        (logging.INFO, "duplicate")
    ]
    with pytest.raises(ValueError):
        log_duplicates_at(logging.ERROR)


def test_failed_logs_its_traceback_at_error(
    sqlite_db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    """Where a handler failed, file, line and function, each exception of the chain as
    its reason (the card-number tests in test_pipeline_attacks check the scrubbing)."""
    caplog.set_level(logging.WARNING, logger="consumerdedup")
    dedup = Deduplicator(sqlite_db.engine, consumer="c", tables=sqlite_db.tables)

    def read_amount(body: dict[str, Any]) -> int:
        try:
            return int(body["amount"])
        except KeyError as exc:
            raise PermanentError("no amount") from exc

    @dedup.handler
    def handle(message: Message, session: Session) -> None:
        read_amount(message.json())

    def traced(line: str) -> None:
        assert "Traceback (most recent call last):" in line
        assert "in read_amount" in line and 'return int(body["amount"])' in line
        assert "KeyError: 'amount'" in line
        assert "direct cause of the following exception" in line
        assert line.rstrip().endswith("PermanentError: no amount")

    assert handle(msg("bad")) is Outcome.FAILED
    (record,) = ours(caplog)
    line = record.getMessage()
    assert record.levelno == logging.ERROR and "reason=PermanentError: no amount" in line
    # Said once, as it happened: on the failed attempt's line, not again on the FAILED one.
    (attempt,) = [r for r in caplog.records if r.name == "consumerdedup.attempts"]
    traced(attempt.getMessage())
    assert "Traceback" not in line
    # With the attempt lines quieted, the FAILED line carries it.
    caplog.clear()
    caplog.set_level(logging.ERROR, logger="consumerdedup.attempts")
    assert handle(msg("bad-2")) is Outcome.FAILED
    (record,) = ours(caplog)
    traced(record.getMessage())


def test_quiet_logger_logs_only_problems(db: Database, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="consumerdedup")
    handle = wrap(db)
    handle.batch([msg("p-1"), msg("p-1"), msg("later", "busy"), msg("bad", "refuse")])
    assert [(r.levelname, r.__dict__["message_id"]) for r in ours(caplog)] == [
        ("WARNING", "later"),
        ("ERROR", "bad"),
    ]


def test_invalid_key_is_logged_with_its_reason(
    db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="consumerdedup")
    wrap(db)(Message(id=None, body=b"{}"))
    (record,) = ours(caplog)
    assert record.levelno == logging.ERROR
    assert "message_id=None" in record.getMessage()
    assert "reason=InvalidMessage: message id must be a str" in record.getMessage()
    assert record.__dict__["message_id"] is None


def test_the_library_prints_nothing(
    db: Database, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG, logger="consumerdedup")
    handle = wrap(db)
    capsys.readouterr()  # whatever the fixtures printed is not ours
    handle(msg("p-1"))
    handle(msg("p-1"))
    handle.batch([msg("bad", "refuse"), msg("later", "busy"), msg("p-2")])
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ""
    assert len(ours(caplog)) == 5  # it all went to the logger instead


# Result and Outcome


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (None, None),
        (PermanentError("refused"), "PermanentError: refused"),
        (PermanentError("two\n   lines\tand tabs"), "PermanentError: two lines and tabs"),
        (RetryLater(), "RetryLater"),
        (KeyError("amount"), "KeyError: 'amount'"),
    ],
)
def test_result_reason_is_one_line(error: BaseException | None, reason: str | None) -> None:
    result = Result(msg("p-1"), Outcome.FAILED if error else Outcome.PROCESSED, error)
    assert result.reason == reason


def test_failed_reason_is_what_gets_recorded(db: Database) -> None:
    result = wrap(db).process(msg("bad", "refuse"))
    assert result.reason == "PermanentError: refused by the handler"
    pe = db.tables.processed_events
    with db.engine.connect() as conn:
        recorded = conn.execute(select(pe.c.outcome, pe.c.error)).all()
    assert recorded == [("failed", result.reason)]


def test_a_long_reason_is_cut_to_the_limit_everywhere_it_goes(db: Database) -> None:
    """A reason travels in log lines, the error column and dead-letter headers: at most
    REASON_LIMIT characters, whatever the handler raised."""
    from consumerdedup.reasons import REASON_LIMIT

    dead: list[Result] = []
    dedup = Deduplicator(
        db.engine, consumer="ledger", tables=db.tables, retry=TWO_TRIES, dead_letter=dead.append
    )

    @dedup.handler
    def handle(message: Message, session: Session) -> None:
        raise PermanentError("no " * 2000)

    result = handle.process(msg("long"))
    assert result.outcome is Outcome.FAILED
    reason = result.reason or ""
    assert len(reason) == REASON_LIMIT and reason.startswith("PermanentError: no no")
    assert reason.endswith("...")
    assert dead and dead[0].reason == reason
    pe = db.tables.processed_events
    with db.engine.connect() as conn:
        assert conn.execute(select(pe.c.error)).scalar_one() == reason


@pytest.mark.parametrize(
    ("outcome", "acks"),
    [
        (Outcome.PROCESSED, True),
        (Outcome.DUPLICATE, True),
        (Outcome.FAILED, True),
        (Outcome.RETRY, False),
    ],
)
def test_outcome_acks(outcome: Outcome, acks: bool) -> None:
    assert outcome.acks is acks


def test_results_say_whether_to_ack(db: Database) -> None:
    handle = wrap(db)
    results: list[Any] = handle.process_batch(
        [msg("p-1"), msg("p-1"), msg("bad", "refuse"), msg("later", "busy")]
    )
    assert [r.outcome.acks for r in results] == [True, True, True, False]


def test_an_observer_that_raises_does_not_break_the_consumer(
    sqlite_db: Any, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[Result] = []

    def broken(result: Result) -> None:
        raise RuntimeError("metrics backend down")

    dedup = Deduplicator(
        sqlite_db.engine, consumer="c", tables=sqlite_db.tables, observers=[broken, seen.append]
    )
    handle = dedup.handler(lambda message, session: None)
    outcomes = handle.batch([Message(id="a", body=b""), Message(id="b", body=b"")])
    assert outcomes == [Outcome.PROCESSED, Outcome.PROCESSED]
    assert [r.message.id for r in seen] == ["a", "b"]
    assert "metrics backend down" in caplog.text
