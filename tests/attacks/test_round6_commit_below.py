"""Round 6: a COMMIT sent below every guard (libpq's ``exec_``, a cursor class made by hand).

Such a COMMIT reaches PostgreSQL: it commits the attempt's claims (claim-first: rows
already PROCESSED) with whatever the handler wrote so far. The guard sees the
transaction ended only afterwards. Before: the claims stayed PROCESSED, so the retry and
every redelivery answered DUPLICATE and the messages' effects were lost. Now the driver
reports the ended transaction (handler_end) and the pipeline deletes exactly the rows
this attempt's claim wrote, in a transaction of its own, before it goes on: the messages
end PROCESSED with their effects or FAILED with a FAILED record, never done without
their effects. What such a COMMIT committed of the handler's own writes stays (a retry
may apply it again: at least once there, not exactly once).

Real PostgreSQL, both drivers, claim-first and check-first, per-message and bulk
handlers, the COMMIT before and after the handler's write, or followed by an error.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Column, MetaData, String, Table, text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from consumerdedup import AsyncDeduplicator, Deduplicator, Message, Outcome, Result, RetryPolicy
from consumerdedup.dedup.failures import ClaimNotUndone
from consumerdedup.errors import RecordedFailure
from tests.attacks.test_round6 import assert_nothing_done_without_effects, effects, recorded
from tests.conftest import Database

FAST = RetryPolicy(attempts=2, initial_delay=timedelta(0), max_delay=timedelta(0))
ROUTES = ["libpq", "cursor"]
WHEN = ["after-write", "before-write", "then-raise"]
MODES = ["claim", "check", "bulk"]


@pytest.fixture
def ledger(pg: Database) -> Database:
    with pg.engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {pg.name('ledger')} (mid TEXT)"))
    return pg


def commit_below(route: str, kind: str) -> Callable[[Any], Any]:
    """COMMIT through libpq itself, or a cursor class made directly (not the factory's)."""

    def sync(raw: Any) -> None:
        if route == "libpq":
            raw.pgconn.exec_(b"COMMIT")
        else:
            psycopg.Cursor(raw).execute("COMMIT")

    async def asynchronous(raw: Any) -> None:
        if route == "libpq":
            raw.pgconn.exec_(b"COMMIT")
        else:
            await psycopg.AsyncCursor(raw).execute("COMMIT")

    return sync if kind == "sync" else asynchronous


def run(
    db: Database,
    kind: str,
    mode: str,
    when: str,
    route: str,
    culprits: set[str],
    messages: list[Message],
    consumer: str = "round6",
    side: Callable[[], None] | None = None,
    dead: list[Result] | None = None,
) -> tuple[list[Result], list[Result]]:
    """The batch twice (the second time as a redelivery), on a handler whose call for any
    of ``culprits`` sends COMMIT below the guards ``when``; ``side`` runs right after it."""
    insert = text(f"INSERT INTO {db.name('ledger')} VALUES (:m)")
    commit = commit_below(route, kind)
    options: dict[str, Any] = {"tables": db.tables, "retry": FAST}
    if dead is not None:
        options["dead_letter"] = dead.append

    def bad(batch: list[Message]) -> bool:
        return any(m.id in culprits for m in batch)

    if kind == "sync":
        dedup = Deduplicator(db.engine, consumer, **options)

        def body(batch: list[Message], session: Any) -> None:
            raw = session.connection().connection.driver_connection
            if bad(batch) and when == "before-write":
                commit(raw)
                if side:
                    side()
            session.execute(insert, [{"m": m.id} for m in batch])
            if bad(batch) and when != "before-write":
                commit(raw)
                if side:
                    side()
                if when == "then-raise":
                    raise RuntimeError("after the commit")

        if mode == "bulk":
            bulk = dedup.bulk_handler(body)
            return bulk.process_batch(messages), bulk.process_batch(messages)
        one = dedup.handler(claim_first=mode == "claim")(lambda m, s: body([m], s))
        return one.process_batch(messages), one.process_batch(messages)

    async def go() -> tuple[list[Result], list[Result]]:
        engine = create_async_engine(db.async_url)
        dedup = AsyncDeduplicator(engine, consumer, **options)

        async def body(batch: list[Message], session: Any) -> None:
            raw = (await (await session.connection()).get_raw_connection()).driver_connection
            if bad(batch) and when == "before-write":
                await commit(raw)
                if side:
                    side()
            await session.execute(insert, [{"m": m.id} for m in batch])
            if bad(batch) and when != "before-write":
                await commit(raw)
                if side:
                    side()
                if when == "then-raise":
                    raise RuntimeError("after the commit")

        async def one_fn(message: Message, session: Any) -> None:
            await body([message], session)

        try:
            if mode == "bulk":
                bulk = dedup.bulk_handler(body)
                return await bulk.process_batch(messages), await bulk.process_batch(messages)
            one = dedup.handler(claim_first=mode == "claim")(one_fn)
            return await one.process_batch(messages), await one.process_batch(messages)
        finally:
            await engine.dispose()

    return asyncio.run(go())


def assert_sound(db: Database, first: list[Result], again: list[Result]) -> None:
    """Invariant 1, and what a redelivery then answers: DUPLICATE exactly for what was
    processed, FAILED (its record) for what failed; no record left claiming work undone."""
    assert_nothing_done_without_effects(db, first + again)
    rows = recorded(db)
    for before, after in zip(first, again, strict=True):
        key = before.message.id
        if before.outcome in (Outcome.PROCESSED, Outcome.DUPLICATE):
            assert rows.get(key) == Outcome.PROCESSED.value
            assert after.outcome is Outcome.DUPLICATE
        else:
            assert before.outcome is Outcome.FAILED, before
            assert rows.get(key) == Outcome.FAILED.value, (key, rows)
            assert after.outcome is Outcome.FAILED
            assert isinstance(after.error, RecordedFailure)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_commit_below_the_guards_fails_its_message_alone(
    ledger: Database, kind: str, mode: str, when: str, route: str
) -> None:
    """m1's call commits below the guards: m1 ends FAILED with its record, its batch-mates
    PROCESSED with their effects (a batch-mate whose writes that COMMIT committed applies
    again: at least once), and a redelivery is DUPLICATE, FAILED, DUPLICATE..."""
    messages = [Message(id=f"m{i}", body=b"{}") for i in range(4)]
    first, again = run(ledger, kind, mode, when, route, {"m1"}, messages)
    assert [r.outcome for r in first] == [
        Outcome.PROCESSED,
        Outcome.FAILED,
        Outcome.PROCESSED,
        Outcome.PROCESSED,
    ], [r.reason for r in first]
    assert_sound(ledger, first, again)
    assert {"m0", "m2", "m3"} <= set(effects(ledger))
    if when == "before-write":  # its write came after the COMMIT: refused, never sent
        assert "m1" not in effects(ledger)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_bulk_handler_that_always_commits_below_the_guards_fails_every_message(
    ledger: Database, kind: str, route: str
) -> None:
    messages = [Message(id=f"m{i}", body=b"{}") for i in range(5)]
    culprits = {m.id for m in messages}
    first, again = run(ledger, kind, "bulk", "after-write", route, culprits, messages)
    assert [r.outcome for r in first] == [Outcome.FAILED] * 5, [r.reason for r in first]
    assert_sound(ledger, first, again)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_the_rows_of_other_consumers_and_of_twins_survive_the_repair(
    ledger: Database, kind: str, mode: str
) -> None:
    """Before the attack: another consumer committed every key, and a twin runner of this
    consumer committed m3. The repair deletes only this attempt's own claims: the other
    consumer's rows and the twin's row stay as they were (same time stamps)."""
    messages = [Message(id=f"m{i}", body=b"{}") for i in range(4)]
    insert = text(f"INSERT INTO {ledger.name('ledger')} VALUES (:m)")
    other = Deduplicator(ledger.engine, "other", tables=ledger.tables, retry=FAST)
    twin = Deduplicator(ledger.engine, "round6", tables=ledger.tables, retry=FAST)
    other.handler(lambda m, s: None).process_batch(messages)
    twin.handler(lambda m, s: s.execute(insert, {"m": m.id})).process_batch(messages[3:])
    before = stamps(ledger)
    first, again = run(ledger, kind, mode, "after-write", "libpq", {"m1", "m3"}, messages)
    assert [r.outcome for r in first] == [
        Outcome.PROCESSED,
        Outcome.FAILED,
        Outcome.PROCESSED,
        Outcome.DUPLICATE,
    ], [r.reason for r in first]
    assert_sound(ledger, first, again)
    after = stamps(ledger)
    assert {k: v for k, v in after.items() if k[0] == "other"} == {
        k: v for k, v in before.items() if k[0] == "other"
    }
    assert after[("round6", "m3")] == before[("round6", "m3")]


@pytest.mark.parametrize("mode", ["claim", "bulk"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_twin_row_written_between_the_commit_and_the_repair_survives(
    ledger: Database, kind: str, mode: str
) -> None:
    """Right after the handler's COMMIT, m2's claim is forgotten and a twin runner claims
    and commits m2 (its own row, its own time stamp, its effect). The repair deletes this
    attempt's other claims but not the twin's row: m2 is then DUPLICATE, applied once."""
    messages = [Message(id=f"m{i}", body=b"{}") for i in range(3)]
    pe, ledger_name = ledger.name("processed_events"), ledger.name("ledger")
    twin_row: dict[tuple[str, str], Any] = {}

    def twin_claims_m2() -> None:
        if twin_row:
            return
        with ledger.engine.begin() as conn:
            conn.execute(text(f"DELETE FROM {pe} WHERE message_id = 'm2'"))
        twin = Deduplicator(ledger.engine, "round6", tables=ledger.tables, retry=FAST)
        insert = text(f"INSERT INTO {ledger_name} VALUES ('m2-twin')")
        assert twin.handler(lambda m, s: s.execute(insert))(messages[2]) is Outcome.PROCESSED
        twin_row.update({k: v for k, v in stamps(ledger).items() if k[1] == "m2"})

    culprits = {"m1"} if mode == "claim" else {"m0", "m1", "m2"}
    first, again = run(
        ledger, kind, mode, "after-write", "libpq", culprits, messages, side=twin_claims_m2
    )
    assert first[1].outcome is Outcome.FAILED, [r.reason for r in first]
    assert first[2].outcome is Outcome.DUPLICATE, [r.reason for r in first]
    assert [r.outcome for r in again[1:]] == [Outcome.FAILED, Outcome.DUPLICATE]
    assert {k: v for k, v in stamps(ledger).items() if k[1] == "m2"} == twin_row
    assert recorded(ledger)["m2"] == Outcome.PROCESSED.value
    assert effects(ledger).count("m2-twin") == 1
    assert recorded(ledger)["m1"] == Outcome.FAILED.value
    if first[0].outcome is Outcome.PROCESSED:
        assert "m0" in effects(ledger)


def stamps(db: Database) -> dict[tuple[str, str], Any]:
    with db.engine.connect() as conn:
        sql = f"SELECT consumer, message_id, processed_at FROM {db.name('processed_events')}"
        return {(r[0], r[1]): r[2] for r in conn.execute(text(sql))}


@pytest.mark.parametrize("mode", ["claim", "bulk"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_repair_that_fails_dead_letters_the_claimed_messages(
    ledger: Database, kind: str, mode: str
) -> None:
    """The DELETE of the claims fails too (a trigger refuses it): the claimed messages end
    FAILED (ClaimNotUndone) and are dead-lettered, so they are not lost unseen behind a
    record that says processed (which stays: forget the key to replay)."""
    refuse_deletes(ledger)
    messages = [Message(id=f"m{i}", body=b"{}") for i in range(3)]
    dead: list[Result] = []
    first, _again = run(ledger, kind, mode, "after-write", "libpq", {"m1"}, messages, dead=dead)
    refused = [r for r in first if isinstance(r.error, ClaimNotUndone)]
    assert refused, [r.reason for r in first]
    assert {r.message.id for r in dead} >= {r.message.id for r in refused}
    for result in first:
        if result.outcome in (Outcome.PROCESSED, Outcome.DUPLICATE):
            assert result.message.id in effects(ledger)
        else:
            assert result.outcome is Outcome.FAILED


def refuse_deletes(db: Database) -> None:
    pe = db.name("processed_events")
    schema = db.schema
    with db.engine.begin() as conn:
        conn.execute(
            text(
                f"CREATE FUNCTION {schema}.no_delete() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN RAISE EXCEPTION 'no deletes here'; END $$"
            )
        )
        conn.execute(
            text(
                f"CREATE TRIGGER no_delete BEFORE DELETE ON {pe} "
                f"FOR EACH ROW EXECUTE FUNCTION {schema}.no_delete()"
            )
        )


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize(
    "misdeed", ["raise", "swallow-db-error", "orm-flush-error", "session-commit-refused"]
)
def test_ordinary_handler_failures_run_no_repair(ledger: Database, kind: str, misdeed: str) -> None:
    """The repair runs only when the transaction ended: with every DELETE on the table
    refused (a tripwire), a handler that raises, swallows a database error, fails at the
    ORM flush or has its session.commit() refused fails as before, never ClaimNotUndone."""
    refuse_deletes(ledger)
    with ledger.engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {ledger.name('uniq')} (k TEXT PRIMARY KEY)"))
        conn.execute(text(f"INSERT INTO {ledger.name('uniq')} VALUES ('taken')"))
    uniq = Table("uniq", MetaData(schema=ledger.schema), Column("k", String, primary_key=True))
    dup = text(f"INSERT INTO {ledger.name('uniq')} VALUES ('taken')")
    messages = [Message(id=f"m{i}", body=b"{}") for i in range(3)]

    if kind == "sync":
        dedup = Deduplicator(ledger.engine, "round6", tables=ledger.tables, retry=FAST)

        @dedup.handler
        def handle(message: Message, session: Any) -> None:
            if message.id != "m1":
                return
            if misdeed == "raise":
                raise RuntimeError("boom")
            if misdeed == "swallow-db-error":
                with contextlib.suppress(Exception):  # swallowed: the transaction aborts
                    session.execute(dup)
            if misdeed == "orm-flush-error":
                session.execute(uniq.insert().values(k="taken"))
            if misdeed == "session-commit-refused":
                session.commit()

        first = handle.process_batch(messages)
    else:

        async def go() -> list[Result]:
            engine = create_async_engine(ledger.async_url)
            dedup = AsyncDeduplicator(engine, "round6", tables=ledger.tables, retry=FAST)

            @dedup.handler
            async def handle(message: Message, session: Any) -> None:
                if message.id != "m1":
                    return
                if misdeed == "raise":
                    raise RuntimeError("boom")
                if misdeed == "swallow-db-error":
                    with contextlib.suppress(Exception):  # swallowed: the transaction aborts
                        await session.execute(dup)
                if misdeed == "orm-flush-error":
                    await session.execute(uniq.insert().values(k="taken"))
                if misdeed == "session-commit-refused":
                    await session.commit()

            try:
                return await handle.process_batch(messages)
            finally:
                await engine.dispose()

        first = asyncio.run(go())
    assert [r.outcome for r in first] == [Outcome.PROCESSED, Outcome.FAILED, Outcome.PROCESSED]
    assert not isinstance(first[1].error, ClaimNotUndone), first[1].reason
    assert recorded(ledger) == {
        "m0": Outcome.PROCESSED.value,
        "m1": Outcome.FAILED.value,
        "m2": Outcome.PROCESSED.value,
    }


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    mode=st.sampled_from(MODES),
    when=st.sampled_from(WHEN),
    size=st.integers(min_value=1, max_value=6),
    culprits=st.sets(st.integers(min_value=0, max_value=5), max_size=3),
)
def test_any_commit_below_the_guards_leaves_nothing_done_without_its_effects(
    pg: Database, mode: str, when: str, size: int, culprits: set[int]
) -> None:
    """Any batch, any messages whose calls commit below the guards, any mode: invariant 1
    holds, and a redelivery answers by the record."""
    with pg.engine.begin() as conn:
        conn.execute(text(f"DROP TABLE IF EXISTS {pg.name('ledger')}"))
        conn.execute(text(f"DELETE FROM {pg.name('processed_events')}"))
        conn.execute(text(f"CREATE TABLE {pg.name('ledger')} (mid TEXT)"))
    messages = [Message(id=f"m{i}", body=b"{}") for i in range(size)]
    bad = {f"m{i}" for i in culprits}
    first, again = run(pg, "sync", mode, when, "libpq", bad, messages)
    assert_sound(pg, first, again)
    for result in first:
        if result.message.id not in bad and mode != "bulk":
            assert result.outcome is Outcome.PROCESSED, result.reason


@pytest.mark.xfail(
    strict=True,
    reason="COMMIT then BEGIN through libpq leaves the driver saying INTRANS: no guard "
    "sees the claims committed in between (it would take a round trip, or the claim's "
    "transaction id compared at COMMIT); a batch-mate's failure then rolls back only the "
    "second transaction and the first's claims stay PROCESSED",
)
def test_a_commit_and_begin_below_the_guards_is_not_seen(ledger: Database) -> None:
    insert = text(f"INSERT INTO {ledger.name('ledger')} VALUES (:m)")
    dedup = Deduplicator(ledger.engine, "round6", tables=ledger.tables, retry=FAST)

    @dedup.handler
    def place(message: Message, session: Any) -> None:
        raw = session.connection().connection.driver_connection
        if message.id == "m0":
            raw.pgconn.exec_(b"COMMIT")
            raw.pgconn.exec_(b"BEGIN")
        session.execute(insert, {"m": message.id})
        if message.id == "m2":
            raise RuntimeError("a batch-mate fails: the span rolls back")

    messages = [Message(id=f"m{i}", body=b"{}") for i in range(3)]
    first, again = place.process_batch(messages), place.process_batch(messages)
    assert_nothing_done_without_effects(ledger, first + again)


@pytest.mark.parametrize("mode", ["claim", "bulk"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_commit_below_the_guards_then_an_orm_write_undoes_the_claims(
    ledger: Database, kind: str, mode: str
) -> None:
    """The COMMIT, then an ORM object added: its flush (after the handler returns) is
    refused, SQLAlchemy rolls the session back itself (an inactive transaction), and the
    claims that COMMIT committed are undone all the same."""

    class Base(DeclarativeBase):
        metadata = MetaData(schema=ledger.schema)

    class Row(Base):
        __tablename__ = "ledger"
        mid: Mapped[str] = mapped_column(String, primary_key=True)

    messages = [Message(id=f"m{i}", body=b"{}") for i in range(3)]

    def write(batch: list[Message], session: Any) -> Any:
        if any(m.id == "m1" for m in batch):
            raw = session.sync_session if kind == "async" else session
            raw.connection().connection.driver_connection.pgconn.exec_(b"COMMIT")
        session.add_all([Row(mid=m.id) for m in batch])

    if kind == "sync":
        dedup = Deduplicator(ledger.engine, "round6", tables=ledger.tables, retry=FAST)
        handler = (
            dedup.bulk_handler(write)
            if mode == "bulk"
            else dedup.handler(lambda m, s: write([m], s))
        )
        first, again = handler.process_batch(messages), handler.process_batch(messages)
    else:

        async def go() -> tuple[list[Result], list[Result]]:
            engine = create_async_engine(ledger.async_url)
            dedup = AsyncDeduplicator(engine, "round6", tables=ledger.tables, retry=FAST)

            async def bulk(batch: list[Message], session: Any) -> None:
                write(batch, session)

            async def one(message: Message, session: Any) -> None:
                write([message], session)

            handler: Any = dedup.bulk_handler(bulk) if mode == "bulk" else dedup.handler(one)
            try:
                return await handler.process_batch(messages), await handler.process_batch(messages)
            finally:
                await engine.dispose()

        first, again = asyncio.run(go())
    assert [r.outcome for r in first] == [
        Outcome.PROCESSED,
        Outcome.FAILED,
        Outcome.PROCESSED,
    ], [r.reason for r in first]
    assert_sound(ledger, first, again)


@pytest.mark.parametrize("mode", ["claim", "bulk"])
def test_a_commit_below_the_guards_on_a_partitioned_table(
    pg_partitioned: Database, mode: str
) -> None:
    """processed_events partitioned by day (claims serialized on advisory locks): the
    claims are undone alike."""
    with pg_partitioned.engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {pg_partitioned.name('ledger')} (mid TEXT)"))
    messages = [Message(id=f"m{i}", body=b"{}") for i in range(4)]
    first, again = run(pg_partitioned, "sync", mode, "after-write", "libpq", {"m1"}, messages)
    assert [r.outcome for r in first] == [
        Outcome.PROCESSED,
        Outcome.FAILED,
        Outcome.PROCESSED,
        Outcome.PROCESSED,
    ], [r.reason for r in first]
    assert_sound(pg_partitioned, first, again)
