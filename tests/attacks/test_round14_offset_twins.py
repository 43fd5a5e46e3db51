"""Attack round 14: offsets in the database and an id repeated in a chunk (7f3af8e).

``KafkaConfig(offsets="database")``: each chunk's transactions write the partition's next
offset. 7f3af8e stops that offset before a later copy of an id whose payload differs from
the first copy's, claims a chunk in which an id comes twice even with ``claim_ids=False``
(so that a copy answered DUPLICATE or PayloadMismatch is answered so again if read again),
and adds a fast path for a plain batch's first attempt. The invariants attacked:

- the stored offset never passes a record that ended FAILED (its dead letter is sent after
  the commit) nor a RETRY one;
- a record read again (after a crash, or the runner's own read again after a RETRY) never
  has its effects applied twice; docs/kafka.md: offsets only, a copy is applied once when
  both copies fall in one chunk.

Through the public API: ``process_deliveries(..., ordered=True, fence=...)`` with an
``OffsetStore``'s fence as the runner makes it (a read again after a crash: the partition
taken anew, its chunk fenced by ``OffsetStore.fence(..., first=...)``), and the real
KafkaConsumerRunner on the Kafka-protocol broker. PostgreSQL (async psycopg).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text

from consumerdedup import (
    AsyncDeduplicator,
    BatchMessageFailed,
    Deduplicator,
    Message,
    Outcome,
    PermanentError,
    RetryLater,
    RetryPolicy,
)
from consumerdedup.adapters.kafka import KafkaConfig, KafkaConsumerRunner
from consumerdedup.adapters.kafka.offsets import OffsetStore
from consumerdedup.breaker import CircuitBreaker
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)

pytestmark = pytest.mark.postgres

QUICK = RetryPolicy(attempts=2, initial_delay=timedelta(0), max_delay=timedelta(0))
APPLIED = (Outcome.PROCESSED, Outcome.DUPLICATE)
DEADLINE = 60.0

# A chunk is written as kinds: "ok", "fail" (PermanentError), "retry" (RetryLater until
# the world is fixed), "flaky" (ValueError on its first call, then passes), "refused" (the
# runner refuses it), "dupN" (a copy of record N, same payload), "dupxN" (a copy of record
# N with another payload).


class World:
    """What the handlers do; ``fixed``: the outage behind "retry" is over."""

    def __init__(self) -> None:
        self.fixed = False
        self.flaked: set[tuple[str, int | None]] = set()

    def act(self, message: Message) -> None:
        kind = json.loads(_raw(message.body))["kind"]
        if kind == "fail":
            raise PermanentError("refused by the handler")
        if kind == "retry" and not self.fixed:
            raise RetryLater("not now")
        if kind == "flaky" and (message.id, message.offset) not in self.flaked:
            self.flaked.add((message.id, message.offset))
            raise ValueError("once")


def _raw(body: Any) -> bytes:
    return body.encode() if isinstance(body, str) else bytes(body)


def chunk(name: str, kinds: list[str], body: Callable[[bytes], Any] = bytes) -> list[Any]:
    delivered: list[tuple[Message, str | None]] = []
    for offset, kind in enumerate(kinds):
        if kind.startswith("dup"):
            source = delivered[int(kind.lstrip("dupx"))][0]
            data = json.loads(_raw(source.body))
            if kind.startswith("dupx"):
                data["v"] += 100 + offset
            raw = json.dumps(data).encode()
            delivered.append((Message(id=source.id, body=body(raw), offset=offset), None))
            continue
        raw = json.dumps({"kind": kind, "v": 1}).encode()
        why = "refused by the runner" if kind == "refused" else None
        delivered.append((Message(id=f"{name}-{offset}", body=body(raw), offset=offset), why))
    return delivered


class Rig:
    """A deduplicator with a per-message and a bulk handler writing a ledger row each, an
    OffsetStore, and the runner's steps: take, process a chunk, crash and read again."""

    def __init__(self, pg: Any, group: str) -> None:
        self.pg = pg
        self.ledger = pg.create_ledger()
        self.insert = text(
            f"INSERT INTO {self.ledger} (account, amount, message_id) VALUES ('a', 1, :m)"
        )
        self.engine = pg.async_engine()
        self.dedup = AsyncDeduplicator(self.engine, consumer="r14", tables=pg.tables, retry=QUICK)
        self.world = World()
        self.store = OffsetStore(self.engine, pg.tables, group)
        world, insert = self.world, self.insert

        async def each(message: Message, session: Any) -> None:
            await session.execute(insert, {"m": message.id})
            world.act(message)

        async def together(messages: list[Message], session: Any) -> None:
            await session.execute(insert, [{"m": m.id} for m in messages])
            for message in messages:
                try:
                    world.act(message)
                except Exception as exc:
                    raise BatchMessageFailed(message, exc) from exc

        self.handlers: dict[str, Any] = {
            "each": self.dedup.handler(each),
            "bulk": self.dedup.bulk_handler(together),
            "check-first": self.dedup.handler(claim_first=False)(each),
        }

    async def run(
        self,
        mode: str,
        partition: int,
        delivered: list[Any],
        claims: bool,
        breaker: CircuitBreaker | None = None,
    ) -> tuple[list[Outcome], int]:
        """A chunk from where the partition was taken (as after a crash: taken anew)."""
        owned = (await self.store.take([("t", partition)]))["t", partition]
        start = owned.stored or 0
        fence = self.store.fence("t", partition, owned, claims=claims, first=start)
        results = await self.handlers[mode].process_deliveries(
            delivered[start:], ordered=True, fence=fence, breaker=breaker
        )
        stored = await self.store.stored("t", partition)
        assert stored is not None
        return [r.outcome for r in results], stored[0] or 0

    def rows(self, prefix: str) -> Counter[str]:
        with self.pg.engine.connect() as conn:
            got = conn.execute(
                text(f"SELECT message_id FROM {self.ledger} WHERE message_id LIKE :p"),
                {"p": f"{prefix}-%"},
            )
            return Counter(r[0] for r in got)

    async def close(self) -> None:
        await self.engine.dispose()


def first_unapplied(outcomes: list[Outcome]) -> int:
    return next((i for i, o in enumerate(outcomes) if o not in APPLIED), len(outcomes))


MODES = ["each", "bulk", "check-first"]
CLAIMS = pytest.mark.parametrize("claims", [False, True], ids=["offsets-only", "with-claims"])


# Findings, fixed (they were strict xfails in a4d98d8):
# - a twin behind a RETRY was applied again when read again: the chunk read again had no
#   twins and went by offset, the recheck looking up its first record only; now every key
#   of such a chunk is looked up, and the runner rechecks after a RETRY too;
# - a copy answered DUPLICATE was dead-lettered when read again from a copy with another
#   payload: it is matched against the recorded payload the first copy's error names;
# - a body changed in place (bytearray) failed a copy the offset had passed: copies are
#   compared by the digests taken at the start, as the offset compares them.


@pytest.mark.parametrize("copy", ["dup0", "dupx0"], ids=["same-payload", "other-payload"])
@pytest.mark.parametrize("mode", MODES)
async def test_a_twin_behind_a_retry_is_not_applied_again_when_read_again(
    pg: Any, mode: str, copy: str
) -> None:
    rig = Rig(pg, f"r14-retry-{mode}-{copy}")
    try:
        delivered = chunk("rt", ["ok", "retry", copy])
        outcomes, stored = await rig.run(mode, 0, delivered, claims=False)
        first = Outcome.DUPLICATE if copy == "dup0" else Outcome.RETRY
        assert outcomes == [Outcome.PROCESSED, Outcome.RETRY, first]
        assert stored == 1  # held at the RETRY: this holds
        rig.world.fixed = True  # the outage is over: the partition is read again from 1
        again, stored = await rig.run(mode, 0, delivered, claims=False)
        assert rig.rows("rt")["rt-0"] == 1, again
        if copy == "dup0":
            assert again == [Outcome.PROCESSED, Outcome.DUPLICATE]
            assert stored == 3
        else:  # the recorded A answers the copy: FAILED, held for its dead letter
            assert again == [Outcome.PROCESSED, Outcome.FAILED]
            assert stored == 2
    finally:
        await rig.close()


@CLAIMS
@pytest.mark.parametrize("mode", MODES)
async def test_a_copy_answered_duplicate_stays_duplicate_when_read_again(
    pg: Any, mode: str, claims: bool
) -> None:
    rig = Rig(pg, f"r14-three-{mode}-{claims}")
    try:
        delivered = chunk("tc", ["ok", "dupx0", "dup0"])
        outcomes, stored = await rig.run(mode, 0, delivered, claims=claims)
        assert outcomes == [Outcome.PROCESSED, Outcome.FAILED, Outcome.DUPLICATE]
        assert stored == 1  # held before the copy with another payload: this holds
        again, _ = await rig.run(mode, 0, delivered, claims=claims)  # killed: read again
        assert again[0] is Outcome.FAILED
        assert rig.rows("tc") == Counter({"tc-0": 1})
        assert again[1] is Outcome.DUPLICATE, again
    finally:
        await rig.close()


@CLAIMS
async def test_a_body_changed_in_place_does_not_let_the_offset_pass_a_failed_copy(
    pg: Any, claims: bool
) -> None:
    rig = Rig(pg, f"r14-mutable-{claims}")
    world, insert = rig.world, rig.insert

    @rig.dedup.handler
    async def scrub(message: Message, session: Any) -> None:
        await session.execute(insert, {"m": message.id})
        world.act(message)
        message.body[:] = b"{}"  # e.g. a buffer wiped after use

    rig.handlers["scrub"] = scrub
    try:
        delivered = chunk("mb", ["ok", "dup0"], body=bytearray)
        outcomes, stored = await rig.run("scrub", 0, delivered, claims=claims)
        assert rig.rows("mb") == Counter({"mb-0": 1})
        assert stored <= first_unapplied(outcomes), (outcomes, stored)
    finally:
        await rig.close()


def _retry_once_then_pass(engine: Any, tables: Any, ledger: str) -> Any:
    dedup = AsyncDeduplicator(engine, consumer="r14-runner", tables=tables, retry=QUICK)
    calls: Counter[str] = Counter()
    insert = text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', 1, :m)")

    @dedup.handler
    async def handle(message: Message, session: Any) -> None:
        calls[message.id] += 1
        if json.loads(message.body).get("retry") and calls[message.id] <= QUICK.attempts:
            raise RetryLater("not now")  # its first chunk's attempts: RETRY, read again
        await session.execute(insert, {"m": message.id})

    return handle


async def test_the_runner_applies_a_twin_behind_a_retry_once(
    kafka: KafkaService, topics: Topics, pg: Any
) -> None:
    ledger = pg.create_ledger()
    topic = await topics.create("r14twin")
    group = "r14twin-" + topic
    stream = [
        ("e-0", json.dumps({"n": 0}).encode()),
        ("e-1", json.dumps({"n": 1, "retry": True}).encode()),
        ("e-0", json.dumps({"n": 0}).encode()),
        ("e-3", json.dumps({"n": 3}).encode()),
    ]
    await topics.produce_many(topic, stream)
    engine = pg.async_engine()
    try:
        runner = KafkaConsumerRunner(
            _retry_once_then_pass(engine, pg.tables, ledger),
            topic,
            bootstrap_servers=kafka.bootstrap,
            group_id=group,
            config=kafka.config(
                poll_timeout=timedelta(milliseconds=100),
                retry_delay=timedelta(0),
                offsets="database",
                claim_ids=False,
                batch_size=3,
            ),
        )
        await asyncio.wait_for(runner.run(until_idle=True), DEADLINE)
    finally:
        await engine.dispose()
    with pg.engine.connect() as conn:
        got = Counter(r[0] for r in conn.exec_driver_sql(f"SELECT message_id FROM {ledger}").all())
    assert got["e-1"] == 1 and got["e-3"] == 1  # all of it was handled
    assert got["e-0"] == 1, got


# What held


HELD = [
    ["ok", "dupx0"],
    ["ok", "dup0", "dupx0", "fail", "retry"],
    ["ok", "refused", "dup0", "ok"],
    ["ok", "refused", "dupx0"],
    ["refused", "ok", "dup1", "dupx1"],
    ["ok", "fail", "dup0", "dupx1"],
    ["fail", "dup0", "ok", "dupx2"],
    ["flaky", "dupx0", "dup0", "ok"],
    ["flaky", "ok", "refused", "dup1"],
    ["ok", "dupx0", "dupx0", "retry"],
    ["retry", "dup0", "ok"],
    ["ok", "dup0", "dup0", "dup0"],
    ["flaky", "flaky", "flaky"],
    ["ok", "flaky", "ok", "fail", "ok"],
    ["ok", "ok", "ok", "dupx0"],
    ["ok", "ok", "retry"],
    ["refused", "dup0", "ok"],
    ["ok", "refused", "dup1", "dup0"],
]


@pytest.mark.parametrize("kinds", HELD, ids=["-".join(k) for k in HELD])
@CLAIMS
@pytest.mark.parametrize("mode", MODES)
async def test_the_offset_holds_and_a_crash_applies_nothing_twice(
    pg: Any, mode: str, claims: bool, kinds: list[str]
) -> None:
    """The stored offset is never past a FAILED or RETRY record; killed after the commit
    and read again from it (the world unchanged), nothing is applied again."""
    rig = Rig(pg, f"r14-held-{mode}-{claims}-{'-'.join(kinds)}")
    try:
        delivered = chunk("h", kinds)
        outcomes, stored = await rig.run(mode, 0, delivered, claims=claims)
        assert stored == first_unapplied(outcomes), (outcomes, stored)
        done = Counter(
            d[0].id for d, o in zip(delivered, outcomes, strict=True) if o is Outcome.PROCESSED
        )
        assert rig.rows("h") == done
        if stored < len(delivered):
            again, stored_again = await rig.run(mode, 0, delivered, claims=claims)
            assert Outcome.PROCESSED not in again, (outcomes, again)
            assert rig.rows("h") == done
            assert stored_again >= stored
            for before, after in zip(outcomes[stored:], again, strict=True):
                if before is Outcome.FAILED:
                    assert after in (Outcome.FAILED, Outcome.RETRY), (outcomes, again)
    finally:
        await rig.close()


@pytest.mark.parametrize("mode", MODES)
async def test_a_plain_batch_that_fails_once_is_not_skipped_by_the_fast_path(
    pg: Any, mode: str
) -> None:
    """A plain batch whose handler fails once (then passes): the later attempts walk the
    slots; every record applied once, the offset past the last."""
    rig = Rig(pg, f"r14-flaky-{mode}")
    try:
        delivered = chunk("fl", ["ok", "flaky", "ok", "flaky", "ok"])
        outcomes, stored = await rig.run(mode, 0, delivered, claims=False)
        assert outcomes == [Outcome.PROCESSED] * 5
        assert stored == 5
        assert rig.rows("fl") == Counter(f"fl-{i}" for i in range(5))
    finally:
        await rig.close()


@pytest.mark.parametrize("kinds", [["ok", "fail", "ok"], ["ok", "fail", "dup0", "ok"]])
@CLAIMS
@pytest.mark.parametrize("mode", MODES)
async def test_a_breaker_opening_mid_batch_holds_the_offset(
    pg: Any, mode: str, claims: bool, kinds: list[str]
) -> None:
    rig = Rig(pg, f"r14-breaker-{mode}-{claims}-{len(kinds)}")
    try:
        delivered = chunk("bk", kinds)
        breaker = CircuitBreaker(1, "r14")
        outcomes, stored = await rig.run(mode, 0, delivered, claims, breaker=breaker)
        assert breaker.open
        assert stored <= first_unapplied(outcomes), (outcomes, stored)
        done = Counter(
            d[0].id for d, o in zip(delivered, outcomes, strict=True) if o is Outcome.PROCESSED
        )
        assert rig.rows("bk") == done
    finally:
        await rig.close()


@pytest.mark.parametrize("named", ["message", "id"])
async def test_a_bulk_handler_naming_the_twin_charges_its_key(pg: Any, named: str) -> None:
    """BatchMessageFailed naming the later copy (not among the call's messages: the copy
    never reaches the handler) or its id: the key fails, the offset holds before it."""
    rig = Rig(pg, f"r14-named-{named}")
    delivered = chunk("nm", ["ok", "ok", "dup1", "ok"])
    twin = delivered[2][0]

    @rig.dedup.bulk_handler
    async def names_twin(messages: list[Message], session: Any) -> None:
        await session.execute(rig.insert, [{"m": m.id} for m in messages])
        if any(m.id == twin.id for m in messages):
            raise BatchMessageFailed(twin if named == "message" else twin.id, PermanentError("x"))

    rig.handlers["named"] = names_twin
    try:
        outcomes, stored = await rig.run("named", 0, delivered, claims=False)
        assert outcomes[0] is Outcome.PROCESSED
        assert outcomes[1] is Outcome.FAILED and outcomes[2] is Outcome.FAILED
        assert stored == 1
        assert rig.rows("nm") == Counter({"nm-0": 1, "nm-3": 1})
    finally:
        await rig.close()


@pytest.mark.parametrize("form", ["str", "memoryview"])
async def test_bodies_that_are_not_bytes(pg: Any, form: str) -> None:
    """A str or memoryview body (hashed at the start): a copy with another payload stops
    the offset, a copy with the same is DUPLICATE."""
    rig = Rig(pg, f"r14-body-{form}")
    to: Callable[[bytes], Any] = bytes.decode if form == "str" else memoryview
    try:
        delivered = chunk("bd", ["ok", "dup0", "ok", "dupx0", "ok"], body=to)
        outcomes, stored = await rig.run("each", 0, delivered, claims=False)
        assert outcomes[:4] == [
            Outcome.PROCESSED,
            Outcome.DUPLICATE,
            Outcome.PROCESSED,
            Outcome.FAILED,
        ]
        assert stored == 3
        again, _ = await rig.run("each", 0, delivered, claims=False)
        assert Outcome.PROCESSED not in again[:1] and again[0] is Outcome.FAILED
        assert rig.rows("bd") == Counter({"bd-0": 1, "bd-2": 1, "bd-4": 1})
    finally:
        await rig.close()


def test_the_blocking_deduplicator_holds_the_offset_before_a_mismatched_copy(pg: Any) -> None:
    engine = pg.engine
    ledger = pg.create_ledger()
    insert = text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', 1, :m)")
    dedup = Deduplicator(engine, consumer="r14-sync", tables=pg.tables, retry=QUICK)

    @dedup.handler
    def each(message: Message, session: Any) -> None:
        session.execute(insert, {"m": message.id})

    store = OffsetStore(engine, pg.tables, "r14-sync")
    delivered = chunk("sy", ["ok", "ok", "dupx0", "dup1"])
    for _ in range(2):  # then killed before the dead letter: read again
        owned = asyncio.run(store.take([("t", 0)]))["t", 0]
        start = owned.stored or 0
        fence = store.fence("t", 0, owned, claims=False, first=start)
        results = each.process_deliveries(delivered[start:], ordered=True, fence=fence)
        stored = asyncio.run(store.stored("t", 0))
        assert stored is not None and stored[0] == 2, [r.outcome for r in results]
    with engine.connect() as conn:
        got = Counter(r[0] for r in conn.execute(text(f"SELECT message_id FROM {ledger}")))
    assert got == Counter({"sy-0": 1, "sy-1": 1})


def test_the_kafka_config_takes_offsets_only() -> None:
    assert KafkaConfig(offsets="database", claim_ids=False).claim_ids is False
