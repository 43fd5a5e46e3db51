"""The bisection property (issue 20 item 1): whichever messages of a batch are poisoned,
exactly those fail and every other one commits, once."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumerdedup import Outcome, PermanentError
from tests.conftest import Database
from tests.support.bulk_ledger import BulkLedger, messages, poisoned

SIZE = 12
_consumers = itertools.count()


@pytest.fixture
def ledger(db: Database) -> Iterator[BulkLedger]:
    chosen = BulkLedger(db, "sync")  # the drivers share the logic; test_bulk.py runs both
    yield chosen
    chosen.close()


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(poison=st.sets(st.integers(0, SIZE - 1)))
def test_exactly_the_poisoned_messages_fail(ledger: BulkLedger, poison: set[int]) -> None:
    consumer = f"prop-{next(_consumers)}"
    prefix = f"{consumer}-"
    batch = messages(SIZE, prefix)
    bad = {batch[i].id for i in poison}
    results = ledger.handler(poisoned(bad, PermanentError), consumer=consumer)(batch)
    failed = {r.message.id for r in results if r.outcome is Outcome.FAILED}
    processed = {r.message.id for r in results if r.outcome is Outcome.PROCESSED}
    assert failed == bad and processed == {m.id for m in batch} - bad
    applied = [i for i in ledger.applied() if i.startswith(prefix)]
    assert applied == sorted(processed)  # each good message's row once, none of a poison's
    recorded = ledger.recorded(consumer)
    assert recorded == {**dict.fromkeys(processed, "processed"), **dict.fromkeys(bad, "failed")}
