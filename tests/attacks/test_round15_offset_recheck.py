"""Attack round 15: offsets in the database, the recheck of a chunk read again (74b63f6).

``KafkaConfig(offsets="database", claim_ids=False)``: a chunk read again after a take, or
from a RETRY record the runner sought back to, looks up all its ids (``fence.recheck``)
and is claimed if one has a record. The runner turns the recheck off once a chunk settled
something (``owned.recheck = False`` in ``_handle_in_database``): only the FIRST chunk read
again is looked up. The records this mode writes (those applied behind a FAILED or refused
record held for its dead letter, and the copies of a chunk claimed for its twins) may lie
further on than that first chunk when it is shorter than the chunk that wrote them: a
``batch_size`` lowered across a restart, or a fetch that returns fewer records. The chunk
behind it then goes by offset alone and applies them a second time.

Invariants: (b) a record read again is never applied twice; (c) a record applied before is
answered DUPLICATE when read again, a FAILED one FAILED again. Through the public API:
``process_deliveries(..., ordered=True, fence=...)`` driven as
``KafkaConsumerRunner._handle_in_database`` drives it (``read_like_the_runner``), and the
real runner on the Kafka-protocol broker.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from consumerdedup import (
    AsyncDeduplicator,
    Message,
    Outcome,
    PermanentError,
    Result,
    SimulatedCrash,
)
from consumerdedup.adapters.kafka import KafkaConsumerRunner
from consumerdedup.adapters.kafka.offsets import OffsetStore
from tests.attacks.test_round14_offset_twins import QUICK, Rig, World, chunk
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)

MODES = ["each", "bulk", "check-first"]
DEADLINE = 60.0
P, D, F, R = Outcome.PROCESSED, Outcome.DUPLICATE, Outcome.FAILED, Outcome.RETRY


async def read_like_the_runner(
    rig: Rig, mode: str, delivered: list[Any], size: int, claims: bool = False, limit: int = 20
) -> dict[int, list[Outcome]]:
    """The partition taken anew (a restart, or a rebalance), then read in chunks of
    ``size`` from the stored offset as KafkaConsumerRunner._handle_in_database does: each
    chunk fenced by ``OffsetStore.fence(..., first=its first offset)`` (looked up below the
    partition's recheck_until), ``OffsetStore.committed`` after it; after a chunk settled
    records (their dead letters sent) the offset is advanced past them; a RETRY seeks back
    to it. Each offset's outcomes, in order."""
    owned = (await rig.store.take([("t", 0)]))["t", 0]
    position = owned.stored or 0
    seen: dict[int, list[Outcome]] = {}
    for _ in range(limit):
        if position >= len(delivered):
            break
        records = delivered[position : position + size]
        fence = rig.store.fence("t", 0, owned, claims, first=position)
        results = await rig.handlers[mode].process_deliveries(records, ordered=True, fence=fence)
        assert not fence.fenced
        rig.store.committed(owned, fence)
        for result in results:
            assert result.message.offset is not None
            seen.setdefault(result.message.offset, []).append(result.outcome)
        done = next((i for i, r in enumerate(results) if r.outcome is R), len(results))
        if done:
            target = position + done
            if (fence.written or 0) < target:  # the dead letters sent: moved past them
                assert await rig.store.advance(fence, target)
            owned.stored = target
        position += done
    return seen


class EachRig(Rig):
    """Rig with its per-message handler only (check-first is refused on MySQL/MariaDB)."""

    def __init__(self, db: Any, group: str, engine: Any = None) -> None:
        self.pg = db
        self.ledger = db.create_ledger()
        self.insert = text(
            f"INSERT INTO {self.ledger} (account, amount, message_id) VALUES ('a', 1, :m)"
        )
        self.engine = db.async_engine() if engine is None else engine
        self.dedup = AsyncDeduplicator(self.engine, consumer="r15", tables=db.tables, retry=QUICK)
        self.world = World()
        self.store = OffsetStore(self.engine, db.tables, group)
        world, insert = self.world, self.insert

        async def each(message: Message, session: Any) -> None:
            await session.execute(insert, {"m": message.id})
            world.act(message)

        self.handlers = {"each": self.dedup.handler(each)}


# Findings


HELD_FOR = ["fail", "refused"]


@pytest.mark.postgres
@pytest.mark.parametrize("held", HELD_FOR)
@pytest.mark.parametrize("mode", MODES)
async def test_a_record_behind_a_held_failure_is_not_applied_again_by_a_shorter_chunk(
    pg: Any, mode: str, held: str
) -> None:
    rig = Rig(pg, f"r15-short-{mode}-{held}")
    try:
        delivered = chunk("sh", ["ok", held, "ok"])
        outcomes, stored = await rig.run(mode, 0, delivered, claims=False)
        assert outcomes == [P, F, P] and stored == 1  # held at X for its dead letter
        # Killed before the dead letter; restarted with batch_size=1.
        seen = await read_like_the_runner(rig, mode, delivered, size=1)
        assert seen[1] == [F]  # X FAILED again (dead-lettered): this holds
        assert rig.rows("sh") == Counter({"sh-0": 1, "sh-2": 1}), seen
        assert seen[2] == [D]
    finally:
        await rig.close()


@pytest.mark.parametrize("db_name", ["mariadb", "sqlite_db"], ids=["mariadb", "sqlite"])
async def test_the_shorter_chunk_on_other_databases(
    request: pytest.FixtureRequest, db_name: str
) -> None:
    rig = EachRig(request.getfixturevalue(db_name), f"r15-short-{db_name}")
    try:
        delivered = chunk("sd", ["ok", "fail", "ok"])
        outcomes, stored = await rig.run("each", 0, delivered, claims=False)
        assert outcomes == [P, F, P] and stored == 1
        seen = await read_like_the_runner(rig, "each", delivered, size=1)
        assert seen[1] == [F]
        assert rig.rows("sd") == Counter({"sd-0": 1, "sd-2": 1}), seen
    finally:
        await rig.close()


@pytest.mark.postgres
@pytest.mark.parametrize("mode", MODES)
async def test_a_twin_behind_a_retry_is_not_applied_again_by_a_shorter_chunk(
    pg: Any, mode: str
) -> None:
    rig = Rig(pg, f"r15-twin-{mode}")
    try:
        delivered = chunk("tw", ["ok", "retry", "dup0"])
        outcomes, stored = await rig.run(mode, 0, delivered, claims=False)
        assert outcomes == [P, R, D] and stored == 1
        rig.world.fixed = True
        seen = await read_like_the_runner(rig, mode, delivered, size=1)
        assert seen[1] == [P]
        assert rig.rows("tw") == Counter({"tw-0": 1, "tw-1": 1}), seen
        assert seen[2] == [D]
    finally:
        await rig.close()


@pytest.mark.postgres
class _ReleaseAtTheFirstFailure(logging.Handler):
    """Ends the lock holder's transaction when the first failed attempt is logged: between
    that attempt and the next one, deterministically."""

    def __init__(self, locker: Any) -> None:
        super().__init__()
        self.locker = locker

    def emit(self, record: logging.LogRecord) -> None:
        if self.locker.in_transaction():
            self.locker.rollback()


async def test_a_recheck_whose_lookup_fails_is_not_dropped(pg: Any) -> None:
    """The recheck's lookup fails (a lock held past lock_timeout), and the lock is gone by
    the next attempt: that attempt looks the ids up again. (It went by offset alone: the
    lookup was switched off before it ran, and C was applied a second time.)"""
    engine = create_async_engine(pg.async_url, connect_args={"options": "-c lock_timeout=300"})
    rig = EachRig(pg, "r15-lookup-fails", engine=engine)
    locker = pg.engine.connect()
    table = pg.name("processed_events")
    attempts = logging.getLogger("consumerdedup.attempts")
    release = _ReleaseAtTheFirstFailure(locker)
    try:
        delivered = chunk("lf", ["ok", "fail", "ok"])
        outcomes, stored = await rig.run("each", 0, delivered, claims=False)
        assert outcomes == [P, F, P] and stored == 1
        # Killed before the dead letter; read again (same size) while a migration holds
        # processed_events: the recheck's SELECT waits past lock_timeout and fails.
        locker.exec_driver_sql(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
        attempts.addHandler(release)
        try:
            seen = await read_like_the_runner(rig, "each", delivered, size=3)
        finally:
            attempts.removeHandler(release)
        assert not locker.in_transaction()  # the lock was met, then released
        assert rig.rows("lf") == Counter({"lf-0": 1, "lf-2": 1}), seen
        assert seen == {1: [F], 2: [D]}
    finally:
        if locker.in_transaction():
            locker.rollback()
        locker.close()
        await rig.close()


def _ledger_handler(engine: Any, tables: Any, ledger: str) -> Any:
    dedup = AsyncDeduplicator(engine, consumer="r15-runner", tables=tables, retry=QUICK)
    insert = text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', 1, :m)")

    @dedup.handler
    async def handle(message: Message, session: Any) -> None:
        await session.execute(insert, {"m": message.id})
        if json.loads(message.body).get("fail"):
            raise PermanentError("refused by the handler")

    return handle


def _runner(kafka: KafkaService, handle: Any, topic: str, group: str, size: int, hook: Any) -> Any:
    return KafkaConsumerRunner(
        handle,
        topic,
        bootstrap_servers=kafka.bootstrap,
        group_id=group,
        config=kafka.config(
            poll_timeout=timedelta(milliseconds=100),
            retry_delay=timedelta(0),
            offsets="database",
            claim_ids=False,
            batch_size=size,
        ),
        before_ack=hook,
    )


@pytest.mark.postgres
async def test_the_runner_restarted_with_a_smaller_batch_applies_nothing_twice(
    kafka: KafkaService, topics: Topics, pg: Any
) -> None:
    ledger = pg.create_ledger()
    topic = await topics.create("r15short")
    group = "r15short-" + topic
    stream = [
        ("e-0", json.dumps({"n": 0}).encode()),
        ("e-1", json.dumps({"n": 1, "fail": True}).encode()),
        ("e-2", json.dumps({"n": 2}).encode()),
    ]
    await topics.produce_many(topic, stream)
    engine = pg.async_engine()
    first: list[list[Outcome]] = []
    again: list[Result] = []

    def crash(results: Sequence[Result]) -> None:
        first.append([r.outcome for r in results])
        raise SimulatedCrash("killed after the database commit, before the dead letter")

    try:
        handle = _ledger_handler(engine, pg.tables, ledger)
        with pytest.raises(SimulatedCrash):
            await asyncio.wait_for(
                _runner(kafka, handle, topic, group, 3, crash).run(until_idle=True), DEADLINE
            )
        assert first == [[P, F, P]]
        restarted = _runner(kafka, handle, topic, group, 1, again.extend)
        await asyncio.wait_for(restarted.run(until_idle=True), DEADLINE)
    finally:
        await engine.dispose()
    with pg.engine.connect() as conn:
        got = Counter(r[0] for r in conn.exec_driver_sql(f"SELECT message_id FROM {ledger}").all())
        offset = conn.exec_driver_sql(
            f"SELECT next_offset FROM {pg.name('consumer_offsets')} "
            "WHERE consumer_group = %(g)s AND topic = %(t)s AND partition = 0",
            {"g": group, "t": topic},
        ).scalar()
    assert offset == 3
    assert len(await topics.records(topic + ".dlq")) == 1  # e-1 dead-lettered: this holds
    assert (again[0].message.id, again[0].outcome) == ("e-1", F)  # dead-lettered again
    assert got == Counter({"e-0": 1, "e-2": 1}), (got, again)


# What held


@pytest.mark.postgres
@pytest.mark.parametrize("held", HELD_FOR)
@pytest.mark.parametrize("mode", MODES)
async def test_the_same_batch_size_read_again_applies_nothing_twice(
    pg: Any, mode: str, held: str
) -> None:
    rig = Rig(pg, f"r15-same-{mode}-{held}")
    try:
        delivered = chunk("ss", ["ok", "ok", held, "ok", "ok"])
        outcomes, stored = await rig.run(mode, 0, delivered, claims=False)
        assert outcomes == [P, P, F, P, P] and stored == 2
        seen = await read_like_the_runner(rig, mode, delivered, size=5)
        assert seen == {2: [F], 3: [D], 4: [D]}
        assert rig.rows("ss") == Counter({"ss-0": 1, "ss-1": 1, "ss-3": 1, "ss-4": 1})
        stored_now = await rig.store.stored("t", 0)
        assert stored_now is not None and stored_now[0] == 5
    finally:
        await rig.close()


@pytest.mark.postgres
@pytest.mark.parametrize("mode", MODES)
async def test_a_retry_repeated_rechecks_each_time(pg: Any, mode: str) -> None:
    """[A, B retry, A copy, C]: B RETRY three reads in a row (each from the seek-back, each
    rechecked and claimed by A's record), then passes: everything once, the copy DUPLICATE."""
    rig = Rig(pg, f"r15-again-{mode}")
    try:
        delivered = chunk("ra", ["ok", "retry", "dup0", "ok"])
        outcomes, stored = await rig.run(mode, 0, delivered, claims=False)
        assert outcomes == [P, R, D, R] and stored == 1
        seen = await read_like_the_runner(rig, mode, delivered, size=4, limit=3)
        assert seen == {1: [R, R, R], 2: [D, D, D], 3: [R, R, R]}
        rig.world.fixed = True
        seen = await read_like_the_runner(rig, mode, delivered, size=4)
        assert seen == {1: [P], 2: [D], 3: [P]}
        assert rig.rows("ra") == Counter({"ra-0": 1, "ra-1": 1, "ra-3": 1})
        stored_now = await rig.store.stored("t", 0)
        assert stored_now is not None and stored_now[0] == 4
    finally:
        await rig.close()


@pytest.mark.postgres
@pytest.mark.parametrize("size", [1, 2, 3])
async def test_a_larger_chunk_read_again_after_a_retry(pg: Any, size: int) -> None:
    """The first read in chunks of ``size``, the read again in chunks of 6 (copies only in
    the chunk read again: copies in two chunks are applied twice, as documented)."""
    rig = Rig(pg, f"r15-larger-{size}")
    try:
        delivered = chunk("lg", ["ok", "ok", "retry", "ok", "dup3", "dup2"])
        await read_like_the_runner(rig, "each", delivered, size=size, limit=6)
        rig.world.fixed = True
        await read_like_the_runner(rig, "each", delivered, size=6)
        assert rig.rows("lg") == Counter({"lg-0": 1, "lg-1": 1, "lg-2": 1, "lg-3": 1})
        stored_now = await rig.store.stored("t", 0)
        assert stored_now is not None and stored_now[0] == 6
    finally:
        await rig.close()


@pytest.mark.postgres
@pytest.mark.parametrize("recorded", [False, True], ids=["none-recorded", "all-recorded"])
async def test_a_recheck_of_500_ids(pg: Any, recorded: bool) -> None:
    """A chunk of 500 read after a take (recheck of every id): none recorded, it goes by
    offset; all but the held FAILED one recorded behind it, it is claimed and answered from
    the records. (The statements run on the driver's cursor, past SQLAlchemy's events: the
    number of SELECTs was not counted here.)"""
    rig = Rig(pg, f"r15-cost-{recorded}")
    try:
        delivered = chunk("co", ["ok", "fail"] + ["ok"] * 499)
        if recorded:
            outcomes, stored = await rig.run("bulk", 0, delivered, claims=False)
            assert stored == 1 and outcomes.count(P) == 500
        else:
            delivered = delivered[:1] + delivered[2:]  # 500 plain ones
        outcomes, _ = await rig.run("bulk", 0, delivered, claims=False)
        if recorded:
            assert outcomes == [F] + [D] * 499
        else:
            assert outcomes == [P] * 500
        assert sum(rig.rows("co").values()) == 500
        assert max(rig.rows("co").values()) == 1
    finally:
        await rig.close()
