"""Round 11 attacks on asyncpg: the verified COMMIT itself.

A deferred constraint trigger runs at COMMIT, so the COMMIT can fail (the trigger raises),
or wait (the trigger waits on a lock the test holds) while the test kills the backend
(pg_terminate_backend) mid-COMMIT. Whatever the COMMIT answers, a message is PROCESSED
only with its record and its effects committed once; a commit-time error fails its
culprit alone (invariant 4); a lost COMMIT is never reported PROCESSED unless it
committed. Real PostgreSQL through postgresql+asyncpg, the public API only.
"""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from consumerdedup import AsyncDeduplicator, Message, Outcome, Result, RetryPolicy
from tests.conftest import Database
from tests.support.async_drivers import async_engine

FAST = RetryPolicy(attempts=3, initial_delay=timedelta(0), max_delay=timedelta(0))


@pytest.fixture
def ledger(pg: Database) -> Database:
    """A ledger whose rows are checked at COMMIT by a deferred trigger: a row 'poison'
    fails the COMMIT; a row 'wait' makes the COMMIT wait on advisory lock 4242."""
    table = pg.name("ledger")
    with pg.engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {table} (mid TEXT)"))
        conn.execute(
            text(
                f"CREATE FUNCTION {pg.schema}.at_commit() RETURNS trigger LANGUAGE plpgsql AS $$ "
                "BEGIN "
                "IF NEW.mid LIKE '%poison%' THEN RAISE EXCEPTION 'refused at commit'; END IF; "
                "IF NEW.mid LIKE '%wait%' THEN PERFORM pg_advisory_xact_lock_shared(4242); "
                "END IF; RETURN NULL; END $$"
            )
        )
        conn.execute(
            text(
                f"CREATE CONSTRAINT TRIGGER at_commit AFTER INSERT ON {table} "
                "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW "
                f"EXECUTE FUNCTION {pg.schema}.at_commit()"
            )
        )
    return pg


def effects(db: Database) -> list[str]:
    with db.engine.connect() as conn:
        return sorted(r[0] for r in conn.execute(text(f"SELECT mid FROM {db.name('ledger')}")))


def recorded(db: Database) -> dict[str, str]:
    with db.engine.connect() as conn:
        pe = db.name("processed_events")
        return dict(conn.execute(text(f"SELECT message_id, outcome FROM {pe}")).all())  # type: ignore[arg-type]


def run_batches(db: Database, batches: list[list[str]], **options: Any) -> list[list[Result]]:
    insert = text(f"INSERT INTO {db.name('ledger')} VALUES (:m)")

    async def go() -> list[list[Result]]:
        engine = async_engine(db.url, "asyncpg", pool_size=2, max_overflow=0)
        dedup = AsyncDeduplicator(engine, "apg", tables=db.tables, retry=FAST, **options)

        @dedup.handler
        async def handle(message: Message, session: Any) -> None:
            await session.execute(insert, {"m": message.id})

        try:
            return [
                await handle.process_batch([Message(id=i, body=b"{}") for i in batch])
                for batch in batches
            ]
        finally:
            await engine.dispose()

    return asyncio.run(go())


def test_a_commit_time_error_fails_its_culprit_alone(ledger: Database) -> None:
    batch = ["m0", "m1-poison", "m2", "m3"]
    first, again = run_batches(ledger, [batch, batch])
    assert [r.outcome for r in first] == [
        Outcome.PROCESSED,
        Outcome.FAILED,
        Outcome.PROCESSED,
        Outcome.PROCESSED,
    ], [r.reason for r in first]
    assert [r.outcome for r in again] == [
        Outcome.DUPLICATE,
        Outcome.FAILED,
        Outcome.DUPLICATE,
        Outcome.DUPLICATE,
    ]
    assert effects(ledger) == ["m0", "m2", "m3"]
    assert recorded(ledger)["m1-poison"] == "failed"


def test_a_lone_message_whose_commit_fails_is_never_processed(ledger: Database) -> None:
    [[result]] = run_batches(ledger, [["poison"]])
    assert result.outcome is Outcome.FAILED, result.reason
    assert effects(ledger) == []
    assert recorded(ledger) == {"poison": "failed"}


def test_the_backend_killed_while_the_commit_waits(ledger: Database) -> None:
    """The COMMIT waits in the deferred trigger on a lock the test holds; the test kills
    that backend (seen waiting on the lock in pg_stat_activity), then lets the lock go.
    The killed COMMIT did not commit: the attempt is retried on a new connection and
    the message ends PROCESSED with its effect once, or RETRY with nothing."""
    engine = create_engine(ledger.url)
    holder = engine.connect()
    holder.execute(text("SELECT pg_advisory_lock(4242)"))
    holder_pid = holder.execute(text("SELECT pg_backend_pid()")).scalar()
    killed: list[int] = []
    errors: list[BaseException] = []

    def killer() -> None:
        try:
            deadline = time.monotonic() + 30
            with engine.connect() as watch:
                while not killed:
                    assert time.monotonic() < deadline, "the COMMIT never waited on the lock"
                    # The backend our holder blocks, in its COMMIT (none of another test's).
                    pid = watch.execute(
                        text(
                            "SELECT pid FROM pg_stat_activity WHERE query LIKE '%COMMIT%' "
                            "AND :holder = ANY(pg_blocking_pids(pid))"
                        ),
                        {"holder": holder_pid},
                    ).scalar()
                    watch.rollback()
                    if pid is not None:
                        watch.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
                        killed.append(pid)
            holder.execute(text("SELECT pg_advisory_unlock(4242)"))
            holder.commit()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        [[result]] = run_batches(ledger, [["m-wait"]])
    finally:
        thread.join(40)
        holder.close()
        engine.dispose()
    assert not errors, errors
    assert len(killed) == 1
    if result.outcome is Outcome.PROCESSED:
        assert effects(ledger) == ["m-wait"]
        assert recorded(ledger) == {"m-wait": "processed"}
    else:
        assert result.outcome is Outcome.RETRY, result.reason
        assert effects(ledger) == []
        assert recorded(ledger) == {}


async def _terminate(raw: Any) -> None:
    raw.terminate()


async def _close(raw: Any) -> None:
    await raw.close()


async def _reset(raw: Any) -> None:
    await raw.reset()


async def _kill_self(raw: Any) -> None:
    await raw.execute("SELECT pg_terminate_backend(pg_backend_pid())")


async def _savepoint_release_ours(raw: Any) -> None:
    await raw.execute("SAVEPOINT consumerdedup_verify")
    await raw.execute("RELEASE SAVEPOINT consumerdedup_verify")


async def _reset_all(raw: Any) -> None:
    await raw.execute("RESET ALL")


async def _discard(raw: Any) -> None:
    await raw.execute("DISCARD ALL")


ENDINGS = {
    "terminate": _terminate,
    "close": _close,
    "reset": _reset,
    "kill-self": _kill_self,
    "our-savepoint-name": _savepoint_release_ours,
    "reset-all": _reset_all,
    "discard-all": _discard,
}


@pytest.mark.parametrize("swallow", [False, True], ids=["raises", "swallows"])
@pytest.mark.parametrize("how", sorted(ENDINGS))
def test_a_handler_that_ends_its_own_connection(ledger: Database, how: str, swallow: bool) -> None:
    """m1 writes, then closes, terminates, resets or kills its own asyncpg connection (or
    plays with the verification's savepoint name). Its batch-mates commit once; m1 is
    PROCESSED with its effect once only if its transaction really committed, and the
    pool's next checkout works."""
    insert = text(f"INSERT INTO {ledger.name('ledger')} VALUES (:m)")

    async def go() -> tuple[list[Result], list[Result]]:
        engine = async_engine(ledger.url, "asyncpg", pool_size=1, max_overflow=0)
        dedup = AsyncDeduplicator(engine, "apg", tables=ledger.tables, retry=FAST)
        done: list[str] = []

        @dedup.handler
        async def handle(message: Message, session: Any) -> None:
            await session.execute(insert, {"m": message.id})
            if message.id == "m1" and not done:
                done.append(how)
                conn = await session.connection()
                raw = (await conn.get_raw_connection()).driver_connection
                try:
                    await ENDINGS[how](raw)
                except Exception:
                    if not swallow:
                        raise

        try:
            batch = [Message(id=i, body=b"{}") for i in ("m0", "m1", "m2")]
            first = await handle.process_batch(batch)
            again = await handle.process_batch(batch)
            return first, again
        finally:
            await engine.dispose()

    first, again = asyncio.run(go())
    outcomes = {r.message.id: r.outcome for r in first}
    assert outcomes["m0"] is Outcome.PROCESSED and outcomes["m2"] is Outcome.PROCESSED, [
        r.reason for r in first
    ]
    rec = recorded(ledger)
    done = effects(ledger)
    assert done.count("m0") == 1 and done.count("m2") == 1
    if rec.get("m1") == "processed":
        assert done.count("m1") == 1
    else:
        assert "m1" not in done
    for result in first + again:
        if result.outcome in (Outcome.PROCESSED, Outcome.DUPLICATE):
            assert rec[result.message.id] == "processed"
            assert done.count(result.message.id) == 1
