"""Property-based: the offset a chunk's transactions write, for random chunks (issue 36).

With ``KafkaConfig(offsets="database")`` the partition's next offset in consumer_offsets is
what decides, after a crash, where the partition is read again. Each example draws a chunk
of 1-10 records whose handlers succeed, fail for good, ask to be retried until their
attempts run out, or repeat an earlier record's id (the same payload, or another one), or
are refused by the runner; it is processed as the runner processes a chunk (ordered, with
the partition's ``OffsetFence``), by a per-message and by a bulk handler, with and without
claims. Then:

- the offset stored is one past the longest run of records, from the chunk's first, that
  were applied or answered DUPLICATE (the first record's own offset if there is none:
  never NULL, or a restart would start where auto_offset_reset says); never past a
  FAILED record (its dead letter is sent after the commit: killed before, it must be read
  again) nor past a RETRY one;
- every record answered PROCESSED has its ledger row exactly once, no other has one.

No broker: OffsetStore and the deduplicator's ``process_deliveries``, as the runner calls
them, on PostgreSQL (async psycopg). The "ci" profile is derandomized.
"""

from __future__ import annotations

import itertools
import json
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from consumerdedup import (
    AsyncDeduplicator,
    Message,
    Outcome,
    PermanentError,
    RetryLater,
    RetryPolicy,
)
from consumerdedup.adapters.kafka.offsets import OffsetStore

pytestmark = pytest.mark.postgres

QUICK = RetryPolicy(attempts=2, initial_delay=timedelta(0), max_delay=timedelta(0))
KINDS = ["ok", "fail", "retry", "twin", "twin-other-payload", "refused"]
APPLIED = (Outcome.PROCESSED, Outcome.DUPLICATE)


def chunk(kinds: list[str], run: int) -> list[tuple[Message, str | None]]:
    """The records of one example, offsets 0..n-1; a twin repeats the id of record 0."""
    delivered: list[tuple[Message, str | None]] = []
    for offset, kind in enumerate(kinds):
        twin = kind.startswith("twin") and offset > 0
        event = f"r{run}-0" if twin else f"r{run}-{offset}"
        body = {"kind": "ok" if twin else kind, "v": 2 if kind == "twin-other-payload" else 1}
        if twin:  # the first record's payload, or another one
            body = {"kind": kinds[0], "v": body["v"]}
        message = Message(id=event, body=json.dumps(body).encode(), offset=offset)
        delivered.append((message, "refused by the runner" if kind == "refused" else None))
    return delivered


def act(message: Message) -> None:
    kind = json.loads(message.body)["kind"]
    if kind == "fail":
        raise PermanentError("refused by the handler")
    if kind == "retry":
        raise RetryLater("not now")


def expected_offset(outcomes: list[Outcome]) -> int:
    """One past the run of applied records from the first: the first record's own offset
    (0) when it is not applied, so that a restart starts at it."""
    return next((i for i, o in enumerate(outcomes) if o not in APPLIED), len(outcomes))


@pytest.mark.parametrize("claims", [False, True], ids=["offsets-only", "with-claims"])
@pytest.mark.parametrize("bulk", [False, True], ids=["per-message", "bulk"])
async def test_the_offset_never_passes_a_failed_or_retried_record(
    pg: Any, bulk: bool, claims: bool
) -> None:
    ledger = pg.create_ledger()
    insert = text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', 1, :m)")
    engine = pg.async_engine()
    dedup = AsyncDeduplicator(engine, consumer="fence-props", tables=pg.tables, retry=QUICK)

    @dedup.handler
    async def each(message: Message, session: Any) -> None:
        await session.execute(insert, {"m": message.id})
        act(message)

    @dedup.bulk_handler
    async def together(messages: list[Message], session: Any) -> None:
        await session.execute(insert, [{"m": m.id} for m in messages])
        for message in messages:
            act(message)

    handler = together if bulk else each
    store = OffsetStore(engine, pg.tables, f"props-{bulk}-{claims}")
    runs = itertools.count()
    examples: list[tuple[int, list[str]]] = []

    @settings(
        max_examples=25,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=10))
    def example(kinds: list[str]) -> None:
        examples.append((next(runs), kinds))

    example()  # the draws first; each is then run on the test's own event loop
    try:
        for run, kinds in examples:
            owned = (await store.take([("t", run)]))["t", run]
            fence = store.fence("t", run, owned, claims=claims)
            delivered = chunk(kinds, run)
            results = await handler.process_deliveries(delivered, ordered=True, fence=fence)
            outcomes = [r.outcome for r in results]
            stored = await store.stored("t", run)
            assert stored is not None
            # NULL only if no transaction committed (all RETRY, or only refused records).
            expected = expected_offset(outcomes)
            assert stored[0] == expected or (expected == 0 and stored[0] is None), (
                kinds,
                outcomes,
                stored,
            )
            with pg.engine.connect() as conn:
                rows = conn.execute(
                    text(f"SELECT message_id FROM {ledger} WHERE message_id LIKE :p"),
                    {"p": f"r{run}-%"},
                )
                written = sorted(r[0] for r in rows)
            done = sorted(r.message.id for r in results if r.outcome is Outcome.PROCESSED)
            assert written == done, (kinds, outcomes)
            # Killed after the commit, before the dead letters and the runner's advance: the
            # partition is taken anew and read again from the offset stored. Nothing is
            # applied again, and what failed fails again (a copy with another payload too).
            again = await store.take([("t", run)])
            owned = again["t", run]
            start = stored[0] or 0
            fence = store.fence("t", run, owned, claims=claims, first=start)
            if start == len(delivered):
                continue
            reread = await handler.process_deliveries(delivered[start:], ordered=True, fence=fence)
            outcomes_again = [r.outcome for r in reread]
            with pg.engine.connect() as conn:
                rows = conn.execute(
                    text(f"SELECT message_id FROM {ledger} WHERE message_id LIKE :p"),
                    {"p": f"r{run}-%"},
                )
                assert sorted(r[0] for r in rows) == written, (kinds, outcomes_again)
            assert Outcome.PROCESSED not in outcomes_again, (kinds, outcomes, outcomes_again)
            for first, second in zip(results[start:], reread, strict=True):
                if first.outcome is Outcome.FAILED:
                    assert second.outcome in (Outcome.FAILED, Outcome.RETRY), (kinds, second)
    finally:
        await engine.dispose()
