"""Attack round 16: offsets in the database, consumer_offsets.recheck_until (718e820).

A chunk commit that holds the partition's offset before the chunk's end raises
``recheck_until`` to that end (a CASE in the offset UPDATE); ``OffsetStore.take`` reads it,
``OffsetStore.fence(..., first=)`` rechecks a chunk starting below it, and
``OffsetStore.committed`` keeps ``Owned`` up. Attacked here through the public API: the
CASE on each database and driver (NULL next offset, only growing, untouched by
``advance`` and by a zombie's fenced commit), the new owner's take, the blocking
Deduplicator, claim_ids switched across a restart, refused records at a chunk's edges,
and the real KafkaConsumerRunner. Verified by ledger rows, consumer_offsets, dead letters.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer  # type: ignore[import-untyped]
from sqlalchemy import select

from consumerdedup import (
    Deduplicator,
    Message,
    Outcome,
    Result,
    SimulatedCrash,
)
from consumerdedup.adapters.kafka import KafkaConsumerRunner
from consumerdedup.adapters.kafka.offsets import OffsetStore
from tests.attacks.test_round14_offset_twins import QUICK, Rig, World, chunk
from tests.attacks.test_round15_offset_recheck import (
    EachRig,
    _ledger_handler,
    read_like_the_runner,
)
from tests.kafka.test_attack_round3 import NotUtf8, raw_header_keys_fixture  # noqa: F401
from tests.support.async_drivers import async_engine
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)

P, D, F, R = Outcome.PROCESSED, Outcome.DUPLICATE, Outcome.FAILED, Outcome.RETRY
DEADLINE = 60.0
DATABASES = ["pg-psycopg", "pg-asyncpg", "mariadb", "sqlite"]


def window(db: Any, group: str, topic: str = "t") -> tuple[int | None, int | None]:
    """(next_offset, recheck_until) of partition 0 as stored."""
    c = db.tables.offsets.c
    with db.engine.connect() as conn:
        row = conn.execute(
            select(c.next_offset, c.recheck_until).where(
                c.consumer_group == group, c.topic == topic, c.partition == 0
            )
        ).one()
    return row[0], row[1]


def _rig(request: pytest.FixtureRequest, which: str, group: str) -> tuple[Any, EachRig]:
    if which.startswith("pg-"):
        db = request.getfixturevalue("pg")
        engine = async_engine(db.url, which[3:]) if which == "pg-asyncpg" else None
        return db, EachRig(db, group, engine=engine)
    db = request.getfixturevalue("sqlite_db" if which == "sqlite" else "mariadb")
    return db, EachRig(db, group)


# What held


@pytest.mark.parametrize("which", DATABASES)
async def test_the_window_is_written_with_a_null_offset_and_only_grows(
    request: pytest.FixtureRequest, which: str
) -> None:
    """The partition's first record FAILED: the offset is stored at it (it was left NULL:
    see test_offsets_in_database's auto_offset_reset="latest" test), recheck_until is the
    chunk's end. Read again one by one (each held chunk's end below it, each advance after
    a dead letter): it is never lowered, everything behind the failure DUPLICATE."""
    group = f"r16-null-{which}"
    db, rig = _rig(request, which, group)
    try:
        delivered = chunk("nu", ["fail", "ok", "ok", "ok"])
        outcomes, stored = await rig.run("each", 0, delivered, claims=False)
        assert outcomes == [F, P, P, P] and stored == 0
        assert window(db, group) == (0, 4)
        seen = await read_like_the_runner(rig, "each", delivered, size=1)
        assert seen == {0: [F], 1: [D], 2: [D], 3: [D]}
        assert rig.rows("nu") == Counter({"nu-1": 1, "nu-2": 1, "nu-3": 1})
        assert window(db, group) == (4, 4)
    finally:
        await rig.close()


@pytest.mark.parametrize("which", ["mariadb", "sqlite"])
async def test_a_twin_behind_a_retry_on_other_databases(
    request: pytest.FixtureRequest, which: str
) -> None:
    group = f"r16-twin-{which}"
    db, rig = _rig(request, which, group)
    try:
        delivered = chunk("tw", ["ok", "retry", "dup0", "ok"])
        outcomes, stored = await rig.run("each", 0, delivered, claims=False)
        assert outcomes == [P, R, D, R] and stored == 1
        assert window(db, group) == (1, 4)
        rig.world.fixed = True
        seen = await read_like_the_runner(rig, "each", delivered, size=1)
        assert seen == {1: [P], 2: [D], 3: [P]}
        assert rig.rows("tw") == Counter({"tw-0": 1, "tw-1": 1, "tw-3": 1})
        assert window(db, group) == (4, 4)
    finally:
        await rig.close()


@pytest.mark.parametrize("which", DATABASES)
async def test_a_zombie_commit_leaves_the_window_and_the_new_owner_reads_it(
    request: pytest.FixtureRequest, which: str
) -> None:
    """Owner 1 commits a held chunk (window 3), owner 2 takes the partition (reads 3), the
    zombie's next held chunk (end 6) is fenced: nothing of it, the window stays 3; owner 2
    reads from 1 in chunks of 1 and applies nothing twice."""
    group = f"r16-zombie-{which}"
    pg, rig = _rig(request, which, group)
    try:
        delivered = chunk("zo", ["ok", "fail", "ok", "ok", "fail", "ok"])
        first = (await rig.store.take([("t", 0)]))["t", 0]
        fence = rig.store.fence("t", 0, first, claims=False, first=0)
        results = await rig.handlers["each"].process_deliveries(
            delivered[:3], ordered=True, fence=fence
        )
        assert [r.outcome for r in results] == [P, F, P]
        rig.store.committed(first, fence)
        assert (first.stored, first.recheck_until) == (1, 3)
        other = OffsetStore(rig.engine, pg.tables, group)
        second = (await other.take([("t", 0)]))["t", 0]
        assert (second.stored, second.recheck_until) == (1, 3)
        zombie = rig.store.fence("t", 0, first, claims=False, first=3)
        results = await rig.handlers["each"].process_deliveries(
            delivered[3:], ordered=True, fence=zombie
        )
        assert zombie.fenced and all(r.outcome is R for r in results)
        assert not await rig.store.advance(zombie, 6)  # its advance changes nothing either
        assert window(pg, group) == (1, 3)
        assert rig.rows("zo") == Counter({"zo-0": 1, "zo-2": 1})
        rig.store = other
        seen = await read_like_the_runner(rig, "each", delivered, size=1)
        assert seen == {1: [F], 2: [D], 3: [P], 4: [F], 5: [P]}
        assert rig.rows("zo") == Counter({"zo-0": 1, "zo-2": 1, "zo-3": 1, "zo-5": 1})
        assert window(pg, group) == (6, 5)  # [zo-4] alone held: its end, below 6
    finally:
        await rig.close()


@pytest.mark.postgres
@pytest.mark.parametrize("mode", ["each", "bulk"])
async def test_a_wide_window_read_again_in_many_short_chunks(pg: Any, mode: str) -> None:
    """A chunk of 40 held at its first record (FAILED), read again in chunks of 7: every
    chunk below the window is looked up, nothing applied twice, a new record past the
    window (offset 40) applied once."""
    group = f"r16-wide-{mode}"
    rig = Rig(pg, group)
    try:
        delivered = chunk("wi", ["fail"] + ["ok"] * 39)
        outcomes, stored = await rig.run(mode, 0, delivered, claims=False)
        assert outcomes == [F] + [P] * 39 and stored == 0
        assert window(pg, group) == (0, 40)
        delivered += chunk("wj", ["ok"] * 41)[40:]
        seen = await read_like_the_runner(rig, mode, delivered, size=7)
        assert seen == {0: [F], **{i: [D] for i in range(1, 40)}, 40: [P]}
        assert sum(rig.rows("wi").values()) == 39 and max(rig.rows("wi").values()) == 1
        assert rig.rows("wj") == Counter({"wj-40": 1})
        assert window(pg, group) == (41, 40)
    finally:
        await rig.close()


@pytest.mark.postgres
@pytest.mark.parametrize("then", [False, True], ids=["claims-then-offsets", "offsets-then-claims"])
@pytest.mark.parametrize("mode", ["each", "bulk"])
async def test_claim_ids_switched_across_a_restart(pg: Any, mode: str, then: bool) -> None:
    """Written under one claim_ids, read again one by one under the other: the held FAILED
    record FAILED again, those behind it DUPLICATE (the bulk one names its culprit with
    BatchMessageFailed)."""
    group = f"r16-switch-{mode}-{then}"
    rig = Rig(pg, group)
    try:
        delivered = chunk("sw", ["ok", "fail", "ok", "ok"])
        outcomes, stored = await rig.run(mode, 0, delivered, claims=not then)
        assert outcomes == [P, F, P, P] and stored == 1
        assert window(pg, group) == (1, 4)
        seen = await read_like_the_runner(rig, mode, delivered, size=1, claims=then)
        assert seen == {1: [F], 2: [D], 3: [D]}
        assert rig.rows("sw") == Counter({"sw-0": 1, "sw-2": 1, "sw-3": 1})
        assert window(pg, group) == (4, 4)
    finally:
        await rig.close()


@pytest.mark.parametrize("which", ["mariadb", "sqlite"])
async def test_claims_then_offsets_on_other_databases(
    request: pytest.FixtureRequest, which: str
) -> None:
    group = f"r16-switch-{which}"
    db, rig = _rig(request, which, group)
    try:
        delivered = chunk("so", ["ok", "fail", "ok", "ok"])
        outcomes, stored = await rig.run("each", 0, delivered, claims=True)
        assert outcomes == [P, F, P, P] and stored == 1
        assert window(db, group) == (1, 4)
        seen = await read_like_the_runner(rig, "each", delivered, size=1)
        assert seen == {1: [F], 2: [D], 3: [D]}
        assert rig.rows("so") == Counter({"so-0": 1, "so-2": 1, "so-3": 1})
        assert window(db, group) == (4, 4)
    finally:
        await rig.close()


EDGES = {
    "refused-last": (["ok", "fail", "ok", "refused"], [P, F, P, F], 1, {1: [F], 2: [D], 3: [F]}),
    "refused-first": (
        ["refused", "ok", "fail", "ok"],
        [F, P, F, P],
        0,
        {0: [F], 1: [D], 2: [F], 3: [D]},
    ),
    "only-refused-behind": (["ok", "refused", "refused"], [P, F, F], 1, {1: [F], 2: [F]}),
}


@pytest.mark.postgres
@pytest.mark.parametrize("edge", list(EDGES))
async def test_refused_records_at_a_chunks_edges(pg: Any, edge: str) -> None:
    kinds, first, held, again = EDGES[edge]
    group = f"r16-edge-{edge}"
    rig = Rig(pg, group)
    try:
        delivered = chunk("ed", kinds)
        outcomes, stored = await rig.run("each", 0, delivered, claims=False)
        assert outcomes == first and stored == held
        seen = await read_like_the_runner(rig, "each", delivered, size=1)
        assert seen == again
        applied = [f"ed-{i}" for i, o in enumerate(first) if o is P]
        assert rig.rows("ed") == Counter(dict.fromkeys(applied, 1))
        assert window(pg, group)[0] == len(kinds)
    finally:
        await rig.close()


class _Blocking:
    """A blocking handler's process_deliveries, awaited in a thread (read_like_the_runner)."""

    def __init__(self, handler: Any) -> None:
        self.handler = handler

    async def process_deliveries(self, records: Any, **options: Any) -> list[Result]:
        return await asyncio.to_thread(self.handler.process_deliveries, records, **options)


@pytest.mark.parametrize("which", ["pg-psycopg", "mariadb", "sqlite"])
async def test_the_blocking_deduplicator_rechecks_a_shorter_chunk(
    request: pytest.FixtureRequest, which: str
) -> None:
    group = f"r16-sync-{which}"
    pg, rig = _rig(request, which, group)
    dedup = Deduplicator(pg.engine, consumer="r16-sync", tables=pg.tables, retry=QUICK)
    insert, world = rig.insert, World()

    @dedup.handler
    def each(message: Message, session: Any) -> None:
        session.execute(insert, {"m": message.id})
        world.act(message)

    rig.store = OffsetStore(pg.engine, pg.tables, group)
    rig.handlers = {"sync": _Blocking(each)}
    try:
        delivered = chunk("sy", ["ok", "ok", "fail", "ok", "ok"])
        outcomes, stored = await rig.run("sync", 0, delivered, claims=False)
        assert outcomes == [P, P, F, P, P] and stored == 2
        assert window(pg, group) == (2, 5)
        seen = await read_like_the_runner(rig, "sync", delivered, size=2)
        assert seen == {2: [F], 3: [D], 4: [D]}
        assert rig.rows("sy") == Counter({"sy-0": 1, "sy-1": 1, "sy-3": 1, "sy-4": 1})
        assert window(pg, group) == (5, 5)
    finally:
        await rig.close()


def _runner(
    kafka: KafkaService, handle: Any, topic: str, group: str, size: int, claims: bool, hook: Any
) -> Any:
    return KafkaConsumerRunner(
        handle,
        topic,
        bootstrap_servers=kafka.bootstrap,
        group_id=group,
        config=kafka.config(
            poll_timeout=timedelta(milliseconds=100),
            retry_delay=timedelta(0),
            offsets="database",
            claim_ids=claims,
            batch_size=size,
        ),
        before_ack=hook,
    )


@pytest.mark.postgres
async def test_the_runner_first_record_failed_under_claims_then_offsets_only(
    kafka: KafkaService, topics: Topics, pg: Any
) -> None:
    """The partition's first record FAILED under claim_ids=True (chunk of 3), killed before
    its dead letter; restarted offsets only with batch_size=1: nothing applied twice, one
    dead letter, the offset past all, the window as the first run left it."""
    ledger = pg.create_ledger()
    topic = await topics.create("r16first")
    group = "r16first-" + topic
    stream = [
        ("e-0", json.dumps({"n": 0, "fail": True}).encode()),
        ("e-1", json.dumps({"n": 1}).encode()),
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
                _runner(kafka, handle, topic, group, 3, True, crash).run(until_idle=True),
                DEADLINE,
            )
        assert first == [[F, P, P]]
        assert window(pg, group, topic) == (0, 3)
        restarted = _runner(kafka, handle, topic, group, 1, False, again.extend)
        await asyncio.wait_for(restarted.run(until_idle=True), DEADLINE)
    finally:
        await engine.dispose()
    with pg.engine.connect() as conn:
        got = Counter(r[0] for r in conn.exec_driver_sql(f"SELECT message_id FROM {ledger}").all())
    assert [(r.message.id, r.outcome) for r in again] == [("e-0", F), ("e-1", D), ("e-2", D)]
    assert len(await topics.records(topic + ".dlq")) == 1
    assert got == Counter({"e-1": 1, "e-2": 1})
    assert window(pg, group, topic) == (3, 3)


@pytest.mark.postgres
async def test_the_runner_reads_alone_past_an_undecodable_record_below_the_window(
    kafka: KafkaService, topics: Topics, pg: Any, raw_header_keys: None
) -> None:
    """[e-0, e-1 FAILED, e-2, undecodable, e-4]: the first run reads alone up to the
    undecodable record (``_read_alone``), commits [e-0, e-1, e-2] held at e-1 and is killed
    before the dead letter; restarted with batch_size=1: nothing applied twice, e-1 and the
    undecodable record dead-lettered once each, e-4 applied, the offset at the end."""
    ledger = pg.create_ledger()
    topic = await topics.create("r16alone")
    group = "r16alone-" + topic
    producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap, acks="all")
    await producer.start()
    try:
        for n, extra in [(0, []), (1, []), (2, []), (3, [(NotUtf8("k"), b"v")]), (4, [])]:
            value = json.dumps({"n": n, "fail": n == 1}).encode()
            headers = [*extra, ("event_id", f"e-{n}".encode())]
            sent = await producer.send_and_wait(topic, value, partition=0, headers=headers)
            assert sent.offset == n
    finally:
        await producer.stop()
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
                _runner(kafka, handle, topic, group, 5, False, crash).run(until_idle=True),
                DEADLINE,
            )
        assert first == [[P, F, P]]
        assert window(pg, group, topic) == (1, 3)
        restarted = _runner(kafka, handle, topic, group, 1, False, again.extend)
        await asyncio.wait_for(restarted.run(until_idle=True), DEADLINE)
    finally:
        await engine.dispose()
    with pg.engine.connect() as conn:
        got = Counter(r[0] for r in conn.exec_driver_sql(f"SELECT message_id FROM {ledger}").all())
    outcomes = [(r.message.offset, r.outcome) for r in again]
    assert outcomes == [(1, F), (2, D), (3, F), (4, P)], outcomes
    assert len(await topics.records(topic + ".dlq")) == 2
    assert got == Counter({"e-0": 1, "e-2": 1, "e-4": 1})
    assert window(pg, group, topic)[0] == 5
