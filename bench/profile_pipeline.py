"""Where a message's time goes in the pipeline: round trips, and CPU per driver step.

Run it: ``.venv/bin/python bench/profile_pipeline.py`` (PostgreSQL at
``CONSUMERDEDUP_BENCH_PG_URL``, default the local ``test`` database; a fresh schema,
dropped at the end). It prints

- the round trips one message costs, read off a libpq trace of the connection (each
  simple Query and each Sync is one request the client waits for), for the handler's
  statement alone through a Session, the pipeline (claim-first), and plain psycopg
  sending the same SQL;
- the client CPU one message costs (``time.process_time``, no profiler), in total and
  per driver step: beginning the transaction, our statements, the handler call with its
  guard, the handler's own statement, the commit;
- in ``.batch(500)``, what each part of the pipeline costs a message, by taking it away
  (an ablation, for this measurement only: the library is patched in this process and put
  back): the handler guard's statement watch (the psycopg cursors that check each
  statement), the whole guard (every check around a handler call), and the accounting
  (counters, the log record, observers). What is left is the decision logic itself (keys,
  payload hashes, the claim's arrays, the outcome of each message).

CPU time is what a loaded machine distorts least (wall time waits on the server and on
other processes); read it as where the time goes, not as a rate.
"""

from __future__ import annotations

import collections
import hashlib
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from consumerdedup import Deduplicator, Message, Tables, install
from consumerdedup.dedup import deduplicator as sync_driver
from consumerdedup.dedup import raw_commit, settings

URL = os.environ.get(
    "CONSUMERDEDUP_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
MESSAGES = 2000
BATCH = 500
ABLATION_ROUNDS = 7


def main() -> int:
    engine = create_engine(URL, pool_size=1, max_overflow=0)  # one connection: one trace
    schema = f"profile_{uuid.uuid4().hex[:8]}"
    tables = Tables.define(f"{schema}.processed_events", f"{schema}.outbox")
    install(engine, tables)
    payments = f"{schema}.payments"
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {payments} (account text, amount int, message_id text)"))
    insert = text(f"INSERT INTO {payments} (account, amount, message_id) VALUES (:a, :n, :m)")
    dedup = Deduplicator(engine, "profile", tables=tables)

    @dedup.handler
    def handle(message: Message, session: Session) -> None:
        session.execute(insert, {"a": message.id[-2:], "n": len(message.body), "m": message.id})

    factory = sessionmaker(engine, expire_on_commit=False)

    def alone(message: Message) -> None:
        with factory() as session:
            session.execute(insert, {"a": message.id[-2:], "n": len(message.body), "m": message.id})
            session.commit()

    plain_url = make_url(URL).set(drivername="postgresql").render_as_string(False)
    raw = psycopg.connect(plain_url)
    claim = (
        f"INSERT INTO {tables.processed_events.fullname} (consumer, message_id, processed_at, "
        "payload_hash, outcome, error) VALUES ('plain', %s, now(), %s, 'processed', NULL) "
        "ON CONFLICT (consumer, message_id) DO NOTHING RETURNING message_id"
    )

    def plain(message: Message) -> None:
        with raw.transaction(), raw.cursor() as cur:
            cur.execute(claim, (message.id, hashlib.sha256(message.body).hexdigest()))
            if cur.fetchone() is not None:
                cur.execute(
                    f"INSERT INTO {payments} (account, amount, message_id) VALUES (%s, %s, %s)",
                    (message.id[-2:], len(message.body), message.id),
                )

    count = iter(range(10**9))

    def fresh(n: int) -> list[Message]:
        tag = next(count)
        return [Message(id=f"p{tag}-{i}", body=b'{"n": %d}' % i) for i in range(n)]

    try:
        print("Round trips per message (libpq trace: simple Query + Sync)")
        for name, run, conn in [
            ("the handler's statement alone", alone, None),
            ("pipeline, claim-first", handle, None),
            ("plain psycopg, same SQL", plain, raw),
        ]:
            for message in fresh(5):  # warm: the pool's connection, prepared statements
                run(message)
            with traced(engine, conn) as sent:
                for message in fresh(10):
                    run(message)
            trips = (sent["Query"] + sent["Sync"]) / 10
            print(f"  {name:<32} {trips:.1f}   ({dict(sent)} for 10 messages)")
        print()
        print(f"Client CPU per message (median of 3 runs of {MESSAGES}; process_time)")
        for name, run in [("the handler's statement alone", alone), ("plain psycopg", plain)]:
            print(f"  {name:<32} {cpu_per_message(run, fresh):6.0f} us")
        steps = collections.Counter[str]()
        with timed_steps(handle, steps):
            total = cpu_per_message(handle, fresh, steps)
        print(f"  {'pipeline, claim-first':<32} {total:6.0f} us, of which:")
        for step, spent in steps.most_common():
            print(f"    {step:<30} {spent / (3 * MESSAGES) * 1e6:6.0f} us")
        print()

        @dedup.handler
        def nothing(_message: Message, _session: Session) -> None:
            pass

        batch_ablation(factory, insert, handle, nothing, fresh)
    finally:
        raw.close()
        with engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        engine.dispose()
    return 0


def batch_ablation(
    factory: Any, insert: Any, handle: Any, nothing: Any, fresh: Callable[[int], list[Message]]
) -> None:
    """Client CPU a message in batches of BATCH: the same handler without dedup, the
    pipeline, and the pipeline with a part taken away; rounds interleaved, medians."""

    def no_dedup(messages: list[Message]) -> None:
        with factory() as session:
            for m in messages:
                session.execute(insert, {"a": m.id[-2:], "n": len(m.body), "m": m.id})
            session.commit()

    def pipeline(messages: list[Message]) -> None:
        handle.batch(messages)

    def pipeline_alone(messages: list[Message]) -> None:
        nothing.batch(messages)

    variants: list[tuple[str, Callable[[list[Message]], None], Callable[[], Iterator[None]]]] = [
        ("the same handler, no dedup", no_dedup, _as_is),
        ("the pipeline", pipeline, _as_is),
        ("  without the statement watch", pipeline, _without_statement_watch),
        ("  without the guard", pipeline, _without_guard),
        ("  without the guard and the accounting", pipeline, _without_guard_and_accounting),
        ("the pipeline around a handler doing nothing", pipeline_alone, _as_is),
    ]
    spent: dict[str, list[float]] = {name: [] for name, *_ in variants}
    for _, run, patched in variants:  # warm: the pool, prepared statements
        with contextmanager(patched)():
            run(fresh(BATCH))
    for _ in range(ABLATION_ROUNDS):
        for name, run, patched in variants:
            batches = [fresh(BATCH) for _ in range(10)]
            with contextmanager(patched)():
                started = time.process_time()
                for messages in batches:
                    run(messages)
                spent[name].append((time.process_time() - started) / (10 * BATCH) * 1e6)
    medians = {name: sorted(values)[len(values) // 2] for name, values in spent.items()}
    base = medians["the same handler, no dedup"]
    print(
        f"Client CPU per message in .batch({BATCH}), each part taken away in turn "
        f"(median of {ABLATION_ROUNDS} interleaved rounds of {10 * BATCH}; process_time)"
    )
    alone = medians.pop("the pipeline around a handler doing nothing")
    for name, value in medians.items():
        extra = f"+{value - base:5.1f}" if value is not base else ""
        print(f"  {name:<42} {value:6.1f} us  {extra:>6}  (CPU ratio {base / value:.2f}x)")
    print(f"  {'the pipeline around a handler doing nothing':<42} {alone:6.1f} us")
    print(
        f"  at 0.9x of the same handler without dedup the pipeline may add "
        f"{base / 0.9 - base:.1f} us a message in all"
    )


def _as_is() -> Iterator[None]:
    yield


def _without_statement_watch() -> Iterator[None]:
    """The guard's checks around each call stay; the cursors are not swapped (commit()
    still refused)."""
    watch = raw_commit._watch_psycopg

    def commit_only(raw: Any, _watch: Any, _coroutine: bool) -> Callable[[], None]:
        own = vars(raw)
        own["commit"] = lambda *_args: None
        return lambda: own.pop("commit", None)

    raw_commit._watch_psycopg = commit_only  # type: ignore[assignment]
    try:
        yield
    finally:
        raw_commit._watch_psycopg = watch


def _without_guard() -> Iterator[None]:
    guarded = sync_driver.DedupHandler._guarded

    def bare(_self: Any, fn: Any, argument: Any, session: Any) -> None:
        fn(argument, session)

    sync_driver.DedupHandler._guarded = bare  # type: ignore[method-assign]
    try:
        yield
    finally:
        sync_driver.DedupHandler._guarded = guarded  # type: ignore[method-assign]


def _without_guard_and_accounting() -> Iterator[None]:
    account = settings.OutcomeReporter._account
    settings.OutcomeReporter._account = lambda _self, _result: None  # type: ignore[method-assign]
    try:
        yield from _without_guard()
    finally:
        settings.OutcomeReporter._account = account  # type: ignore[method-assign]


def cpu_per_message(
    run: Callable[[Message], Any],
    fresh: Callable[[int], list[Message]],
    steps: collections.Counter[str] | None = None,
) -> float:
    for message in fresh(100):
        run(message)
    if steps is not None:
        steps.clear()
    spent = []
    for _ in range(3):
        messages = fresh(MESSAGES)
        started = time.process_time()
        for message in messages:
            run(message)
        spent.append((time.process_time() - started) / MESSAGES * 1e6)
    return sorted(spent)[1]


@contextmanager
def traced(engine: Any, conn: psycopg.Connection[Any] | None) -> Iterator[collections.Counter[str]]:
    """The frontend messages sent on ``conn`` (else the engine's one pooled connection)."""
    sent: collections.Counter[str] = collections.Counter()
    pooled = engine.raw_connection() if conn is None else None
    target = conn if conn is not None else pooled.driver_connection  # type: ignore[union-attr]
    if pooled is not None:
        pooled.close()  # back to the pool: the next checkout is this connection
    with tempfile.TemporaryFile("w+") as trace:
        target.pgconn.trace(trace.fileno())
        try:
            yield sent
        finally:
            target.pgconn.untrace()
            trace.seek(0)
            for line in trace:
                fields = line.split("\t")
                if len(fields) > 3 and fields[1] == "F":
                    sent[fields[3].split(" ")[0].strip()] += 1


@contextmanager
def timed_steps(handler: Any, steps: collections.Counter[str]) -> Iterator[None]:
    """Add each driver step's process time to ``steps`` while the block runs."""

    def timing(name: Callable[[Any], str], fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                steps[name(args)] += time.process_time() - started

        return timed

    carry_out, begin, own = (
        sync_driver.DedupHandler._carry_out,
        sync_driver.begin_checked,
        handler.fn,
    )
    op_names = {
        "Execute": "our statements (claim)",
        "CallHandler": "handler call, guard included",
        "Commit": "COMMIT",
        "Rollback": "ROLLBACK",
    }
    sync_driver.DedupHandler._carry_out = timing(  # type: ignore[method-assign]
        lambda args: op_names.get(type(args[1]).__name__, type(args[1]).__name__), carry_out
    )
    sync_driver.begin_checked = timing(lambda args: "begin (session.connection)", begin)
    handler.fn = timing(lambda args: "  the handler's own statement", own)
    try:
        yield
    finally:
        sync_driver.DedupHandler._carry_out = carry_out  # type: ignore[method-assign]
        sync_driver.begin_checked = begin
        handler.fn = own


if __name__ == "__main__":
    sys.exit(main())
