"""Property-based: random batches of random handler behaviours through the whole pipeline.

Each example draws a batch (1-12 messages) whose handlers succeed, ask to be retried
n times, refuse the message, swallow a database error, break a deferred foreign key
(PostgreSQL) or carry an id the database cannot store, with duplicate ids inside the
batch (same or another payload). The batch is processed, then processed again as a
redelivery after a crash between commit and ack. After every call the database is
checked against what was answered:

- PROCESSED / DUPLICATE: the effect and the record ('processed') exactly once;
- FAILED: the record ('failed') and no effect (InvalidMessage: no record at all;
  PayloadMismatch: no effect of that payload, the first payload's record stands);
- RETRY: neither;
- ordered=True: no effect committed behind the first RETRY;
- every call returns within DEADLINE.

Every combination runs: Deduplicator and AsyncDeduplicator, claim-first and check-first,
PostgreSQL and SQLite, ``process_batch(messages)`` and ``process_batch(messages, ordered=True)``.
The business table has no unique key: only the pipeline keeps an effect from doubling.

The "ci" profile (default) is derandomized, so CI sees the same examples each run; set
HYPOTHESIS_PROFILE=explore for fresh random ones. A failure prints its reproduction blob.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import threading
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from sqlalchemy import text

from consumerdedup import (
    AsyncDeduplicator,
    Deduplicator,
    InvalidMessage,
    Message,
    Outcome,
    PayloadMismatch,
    PermanentError,
    RecordedFailure,
    Result,
    RetryLater,
    RetryPolicy,
)
from consumerdedup.errors import HeldBack
from tests.conftest import Database, database
from tests.support.flavors import SWALLOW, run_step, run_step_async

ATTEMPTS = 3
POLICY = RetryPolicy(attempts=ATTEMPTS, initial_delay=timedelta(0), max_delay=timedelta(0))
DEADLINE = float(os.environ.get("CONSUMERDEDUP_PROPERTY_DEADLINE", "60"))
"""Seconds one process_batch call may take: every message is decided in bounded time."""

settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    derandomize=True,
    print_blob=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.register_profile(
    "explore",
    max_examples=300,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")

OK, TRANSIENT, PERMANENT, SWALLOWS, DEFERRED, INVALID = (
    "ok",
    "transient",
    "permanent",
    "swallow",
    "deferred",
    "invalid",
)
BAD_IDS = ("", "x" * 256, "a\x00b")

pytestmark = pytest.mark.timeout(1800)


# --- what a batch is made of -------------------------------------------------------------------


@dataclass(frozen=True)
class Draw:
    """One message of a drawn batch, before it gets this example's ids."""

    behaviour: str
    times: int = 0
    """TRANSIENT: how many calls raise RetryLater before one succeeds."""
    copy_of: int | None = None
    """Index of an earlier message whose id this one repeats."""
    same_payload: bool = True
    bad_id: str = ""


def draws(dialect: str) -> st.SearchStrategy[list[Draw]]:
    kinds = [OK, OK, OK, TRANSIENT, TRANSIENT, PERMANENT, SWALLOWS, INVALID]
    if dialect == "postgresql":
        kinds.append(DEFERRED)  # SQLite enforces no deferred foreign key here

    @st.composite
    def fresh(draw: st.DrawFn) -> Draw:
        behaviour = draw(st.sampled_from(kinds))
        if behaviour == TRANSIENT:
            return Draw(TRANSIENT, times=draw(st.integers(1, ATTEMPTS + 1)))
        if behaviour == INVALID:
            return Draw(INVALID, bad_id=draw(st.sampled_from(BAD_IDS)))
        return Draw(behaviour)

    @st.composite
    def batch(draw: st.DrawFn) -> list[Draw]:
        size = draw(st.integers(1, 12))
        out: list[Draw] = []
        for _ in range(size):
            originals = [
                i for i, d in enumerate(out) if d.copy_of is None and d.behaviour != INVALID
            ]
            if originals and draw(st.integers(0, 3)) == 0:  # about one in four: a repeated id
                index = draw(st.sampled_from(originals))
                out.append(
                    Draw(
                        out[index].behaviour,
                        out[index].times,
                        copy_of=index,
                        same_payload=draw(st.booleans()),
                    )
                )
            else:
                out.append(draw(fresh()))
        return out

    return batch()


def build(example: int, drawn: Sequence[Draw]) -> list[Message]:
    messages: list[Message] = []
    for i, d in enumerate(drawn):
        if d.behaviour == INVALID:
            mid, variant = d.bad_id, f"v{i}"
        elif d.copy_of is not None:
            original = messages[d.copy_of]
            mid = original.id
            variant = json.loads(original.body)["v"] if d.same_payload else f"v{i}"
        else:
            mid, variant = f"e{example}-m{i}", f"v{i}"
        body = {"b": d.behaviour, "n": d.times, "v": variant}
        messages.append(Message(id=mid, body=json.dumps(body).encode(), source="props"))
    return messages


# --- the database side -------------------------------------------------------------------------


class Tables:
    """The business tables every example shares; rows carry the example's number."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.ledger = db.name("ledger")
        self.taken = db.name("taken")
        self.parent = db.name("parent")
        self.child = db.name("child")
        serial = (
            "INTEGER PRIMARY KEY AUTOINCREMENT" if db.dialect == "sqlite" else "SERIAL PRIMARY KEY"
        )
        with db.engine.begin() as conn:
            conn.exec_driver_sql(
                f"CREATE TABLE {self.ledger} "
                f"(seq {serial}, example INTEGER, message_id TEXT, variant TEXT)"
            )
            conn.exec_driver_sql(f"CREATE TABLE {self.taken} (k TEXT PRIMARY KEY)")
            conn.exec_driver_sql(f"INSERT INTO {self.taken} VALUES ('k')")
            if db.dialect == "postgresql":
                conn.exec_driver_sql(f"CREATE TABLE {self.parent} (id TEXT PRIMARY KEY)")
                conn.exec_driver_sql(
                    f"CREATE TABLE {self.child} "
                    f"(parent TEXT REFERENCES {self.parent} DEFERRABLE INITIALLY DEFERRED)"
                )

    def steps(self, example: int, message: Message) -> list[tuple[str, dict[str, Any]]]:
        """What the handler runs for ``message`` (after its RetryLater, if any)."""
        data = message.json()
        steps = [
            (
                f"INSERT INTO {self.ledger} (example, message_id, variant) VALUES (:e, :m, :v)",
                {"e": example, "m": message.id, "v": data["v"]},
            )
        ]
        if data["b"] == SWALLOWS:  # except IntegrityError: pass, with no savepoint
            steps.append((f"{SWALLOW}INSERT INTO {self.taken} VALUES ('k')", {}))
        elif data["b"] == DEFERRED:  # checked at COMMIT only
            steps.append((f"INSERT INTO {self.child} VALUES (:p)", {"p": f"orphan-{message.id}"}))
        return steps

    def effects(self, example: int) -> list[tuple[str, str]]:
        """(message id, variant) of each ledger row of the example, in insertion order."""
        with self.db.engine.connect() as conn:
            rows = conn.execute(
                text(
                    f"SELECT message_id, variant FROM {self.ledger} WHERE example = :e ORDER BY seq"
                ),
                {"e": example},
            )
            return [(r[0], r[1]) for r in rows]

    def records(self, consumer: str) -> dict[str, tuple[str, str]]:
        """message id -> (outcome, payload hash) of the consumer's dedup records."""
        pe = self.db.tables.processed_events
        with self.db.engine.connect() as conn:
            rows = conn.execute(pe.select().where(pe.c.consumer == consumer))
            found: dict[str, tuple[str, str]] = {}
            for r in rows:
                assert r.message_id not in found, f"two records for {r.message_id!r}"
                found[r.message_id] = (r.outcome, r.payload_hash)
            return found


# --- running one batch on either deduplicator --------------------------------------------------


class Driver:
    """Deduplicator or AsyncDeduplicator over ``db``; each example gets its own consumer."""

    def __init__(self, db: Database, kind: str, claim_first: bool, ordered: bool) -> None:
        self.db = db
        self.kind = kind
        self.claim_first = claim_first
        self.ordered = ordered
        self.tables = Tables(db)
        self.numbers = itertools.count(1)
        if kind == "async":
            self.loop = asyncio.new_event_loop()
            self.async_engine = db.async_engine()

    def handler(self, example: int, calls: Counter[str]) -> Callable[[list[Message]], list[Result]]:
        consumer = f"c{example}"
        tables = self.tables

        def before(message: Message) -> None:
            calls[message.id] += 1
            data = message.json()
            if data["b"] == TRANSIENT and calls[message.id] <= data["n"]:
                raise RetryLater(f"call {calls[message.id]} of {message.id}")

        def after(message: Message) -> None:
            if message.json()["b"] == PERMANENT:  # after its write: that must roll back
                raise PermanentError("refused")

        if self.kind == "sync":
            dedup = Deduplicator(self.db.engine, consumer, tables=self.db.tables, retry=POLICY)

            @dedup.handler(claim_first=self.claim_first)
            def handle(message: Message, session: Any) -> None:
                before(message)
                for sql, params in tables.steps(example, message):
                    run_step(session, sql, params)
                after(message)

            def run_sync(messages: list[Message]) -> list[Result]:
                # In a daemon thread, so that a call that never returns fails the test.
                answer: list[list[Result] | BaseException] = []

                def call() -> None:
                    try:
                        answer.append(handle.process_batch(messages, ordered=self.ordered))
                    except BaseException as exc:
                        answer.append(exc)

                thread = threading.Thread(target=call, daemon=True)
                thread.start()
                thread.join(DEADLINE)
                assert not thread.is_alive(), f"process_batch still running after {DEADLINE}s"
                if isinstance(answer[0], BaseException):
                    raise answer[0]
                return answer[0]

            return run_sync

        adedup = AsyncDeduplicator(self.async_engine, consumer, tables=self.db.tables, retry=POLICY)

        @adedup.handler(claim_first=self.claim_first)
        async def ahandle(message: Message, session: Any) -> None:
            before(message)
            for sql, params in tables.steps(example, message):
                await run_step_async(session, sql, params)
            after(message)

        def run_async(messages: list[Message]) -> list[Result]:
            call = ahandle.process_batch(messages, ordered=self.ordered)
            return self.loop.run_until_complete(asyncio.wait_for(call, DEADLINE))

        return run_async

    def close(self) -> None:
        if self.kind == "async":
            self.loop.run_until_complete(self.async_engine.dispose())
            self.loop.close()


# --- what must hold ----------------------------------------------------------------------------


def variant(message: Message) -> str:
    return str(json.loads(message.body)["v"])


def check_invariants(
    tables: Tables,
    example: int,
    consumer: str,
    results: Sequence[Result],
    before: Sequence[tuple[str, str]],
    ordered: bool,
    recorded_before: Collection[str] = (),
) -> None:
    """What the database holds agrees with every answer of one call."""
    effects = tables.effects(example)
    records = tables.records(consumer)
    per_key = Counter(mid for mid, _ in effects)
    assert all(n == 1 for n in per_key.values()), f"an effect applied twice: {per_key}"
    # A key decided before this message (by an earlier delivery, or a twin ahead of it in this
    # batch) keeps that decision's effect and record whatever this message's own answer is.
    decided = set(recorded_before)
    for result in results:
        key, outcome, error = result.message.id, result.outcome, result.error
        mine = (key, variant(result.message))
        where = f"{key!r} {outcome.name} ({result.reason}); effects {effects}; records {records}"
        if outcome in (Outcome.PROCESSED, Outcome.DUPLICATE):
            assert per_key[key] == 1 and mine in effects, where
            assert records.get(key, ("",))[0] == "processed", where
        elif outcome is Outcome.FAILED and isinstance(error, InvalidMessage):
            assert per_key[key] == 0 and key not in records, where
        elif outcome is Outcome.FAILED and isinstance(error, PayloadMismatch):
            assert mine not in effects, where  # the first payload's effect and record stand
        elif outcome is Outcome.FAILED:
            assert per_key[key] == 0, where
            assert records.get(key, ("",))[0] == "failed", where
        else:
            assert outcome is Outcome.RETRY, where
            if isinstance(error, HeldBack) and key in decided:
                assert mine not in Counter(effects) - Counter(before) or key in ahead_of(
                    results, result
                ), where
            else:
                assert per_key[key] == 0 and key not in records, where
        if outcome is not Outcome.RETRY:
            decided.add(key)
    if ordered:
        first_retry = next(
            (i for i, r in enumerate(results) if r.outcome is Outcome.RETRY), len(results)
        )
        ahead = {r.message.id for r in results[: first_retry + 1]}
        behind = {r.message.id for r in results[first_retry + 1 :]} - ahead
        new = Counter(effects) - Counter(before)
        late = [e for e in new.elements() if e[0] in behind]
        assert not late, f"committed behind the first RETRY (#{first_retry}): {late}"


def ahead_of(results: Sequence[Result], result: Result) -> set[str]:
    """The keys answered, not RETRY, before ``result`` in one call."""
    keys: set[str] = set()
    for other in results:
        if other is result:
            break
        if other.outcome is not Outcome.RETRY:
            keys.add(other.message.id)
    return keys


def expected_first_pass(
    drawn: Sequence[Draw], dialect: str, results: Sequence[Result], ordered: bool
) -> None:
    """The exact answers of the first delivery (a redelivery finds the records)."""
    base = {
        OK: Outcome.PROCESSED,
        PERMANENT: Outcome.FAILED,
        SWALLOWS: Outcome.FAILED if dialect == "postgresql" else Outcome.PROCESSED,
        DEFERRED: Outcome.FAILED,
    }
    held = False
    spent = cut = False  # an outage used up one message's attempts; then it recurred
    leaders: dict[int, Result] = {}
    for i, (d, result) in enumerate(zip(drawn, results, strict=True)):
        got = result.outcome
        where = f"#{i} {d}: {got.name} ({result.reason})"
        if held and d.copy_of is None and d.behaviour == TRANSIENT:
            cut, spent = spent, spent or d.times >= ATTEMPTS
        if held:  # ordered: behind the first RETRY nothing commits and no failure is reported
            if d.copy_of is None:
                leaders[i] = result
            elif d.same_payload and got is Outcome.DUPLICATE:  # commits nothing: may be said
                assert leaders[d.copy_of].outcome in (Outcome.PROCESSED, Outcome.DUPLICATE), where
                continue
            elif d.same_payload and leaders[d.copy_of].outcome is Outcome.RETRY:
                assert got is Outcome.RETRY, where  # a twin shares its leader's answer
                continue
            assert got is Outcome.RETRY and isinstance(result.error, HeldBack), where
            continue
        if d.behaviour == INVALID:
            assert got is Outcome.FAILED and isinstance(result.error, InvalidMessage), where
            continue
        if d.copy_of is not None:
            leader = leaders[d.copy_of]
            if not d.same_payload:
                assert got is Outcome.FAILED and isinstance(result.error, PayloadMismatch), where
            elif leader.outcome in (Outcome.PROCESSED, Outcome.DUPLICATE):
                assert got is Outcome.DUPLICATE, where
            else:
                assert got is leader.outcome, where
            continue
        leaders[i] = result
        if d.behaviour == TRANSIENT:
            want = Outcome.RETRY if d.times >= ATTEMPTS or spent else Outcome.PROCESSED
        else:
            want = base[d.behaviour]
        if cut:  # the outage recurred after it used up one message's attempts: not tried
            want = Outcome.RETRY
        elif d.behaviour == TRANSIENT:
            cut, spent = spent, spent or d.times >= ATTEMPTS
        if got is Outcome.RETRY and "undecided after" in (result.reason or ""):
            note(f"attempt budget spent at #{i}")  # bounded, allowed: delivered again
        else:
            assert got is want, where
        held = ordered and got is Outcome.RETRY


def expected_redelivery(
    messages: Sequence[Message],
    recorded: dict[str, tuple[str, str]],
    results: Sequence[Result],
    calls_before: Counter[str],
    calls: Counter[str],
    ordered: bool,
) -> None:
    """A key recorded by the first delivery is answered from its record; its handler not run.

    On an ordered source, what is behind the first RETRY is held back (RETRY) instead."""
    from consumerdedup.message import payload_hash

    held = False
    for message, result in zip(messages, results, strict=True):
        was_held, held = held, held or (ordered and result.outcome is Outcome.RETRY)
        if message.id not in recorded:
            continue
        outcome, digest = recorded[message.id]
        got = (result.outcome, type(result.error))
        where = f"{message.id!r} recorded {outcome}: got {got} ({result.reason})"
        assert calls[message.id] == calls_before[message.id], f"{message.id!r}: handler ran again"
        if was_held and got != (Outcome.DUPLICATE, type(None)):
            assert got == (Outcome.RETRY, HeldBack), where
        elif payload_hash(message.body) != digest:
            assert got == (Outcome.FAILED, PayloadMismatch), where
        elif outcome == "processed":
            assert got == (Outcome.DUPLICATE, type(None)), where
        else:
            assert got == (Outcome.FAILED, RecordedFailure), where


# --- the property ------------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    yield from database(request, request.param, tmp_path)


@pytest.fixture(params=["sync", "async"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "ordered"])
def test_random_batches_keep_every_invariant(
    db: Database, kind: str, claim_first: bool, ordered: bool
) -> None:
    driver = Driver(db, kind, claim_first, ordered)
    try:

        @settings(settings.get_profile(PROFILE))
        @given(drawn=draws(db.dialect))
        def prop(drawn: list[Draw]) -> None:
            example = next(driver.numbers)
            consumer = f"c{example}"
            messages = build(example, drawn)
            note(f"example {example}: {drawn}")
            calls: Counter[str] = Counter()
            run = driver.handler(example, calls)

            first = run(messages)
            assert [r.message for r in first] == messages
            note(f"first delivery: {[(r.outcome.name, r.reason) for r in first]}")
            check_invariants(driver.tables, example, consumer, first, [], ordered)
            expected_first_pass(drawn, db.dialect, first, ordered)

            # The consumer crashed after COMMIT, before the ack: the broker delivers it again.
            recorded = driver.tables.records(consumer)
            before, calls_before = driver.tables.effects(example), Counter(calls)
            again = run(messages)
            note(f"redelivery: {[(r.outcome.name, r.reason) for r in again]}")
            check_invariants(driver.tables, example, consumer, again, before, ordered, recorded)
            expected_redelivery(messages, recorded, again, calls_before, calls, ordered)

        prop()
    finally:
        driver.close()
