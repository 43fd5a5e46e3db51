"""The runner contract, one scenario per sentence, for every broker adapter.

An adapter's test module subclasses ``RunnerContract`` and provides a
``harness`` fixture: a ``RunnerHarness`` (tests/contracts/harness.py) of its
broker, which adds the few probes that publish to and inspect it. What an
adapter cannot promise it declares in ``Capabilities``; the suite then checks
the weaker promise instead of skipping. The sentences are in
consumerdedup/lifecycle.py.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import pytest

from consumerdedup import Message, PermanentError, RetryLater, SimulatedCrash
from tests.contracts.harness import RunnerHarness as Harness


def body(amount: int = 1, **controls: Any) -> bytes:
    return json.dumps({"amount": amount, **controls}).encode()


class Ledger:
    """The business side of every scenario: one row per applied message."""

    def __init__(self, db: Any) -> None:
        self.db = db
        self.table = db.create_ledger()
        self.calls: list[str] = []
        self._lock = threading.Lock()

    def behavior(self, message: Message) -> list[tuple[str, dict[str, Any]]]:
        data = message.json()
        with self._lock:
            self.calls.append(message.id)
            seen = self.calls.count(message.id)
        if data.get("die") and seen == 1:
            raise SimulatedCrash("the consumer process died inside the handler")
        if data.get("fail") == "permanent":
            raise PermanentError("poison: refused by the handler")
        if seen <= data.get("retry_times", 0):
            raise RetryLater(f"try {seen} refused")
        if data.get("slow"):
            time.sleep(data["slow"])
        return [
            (
                f"INSERT INTO {self.table} (account, amount, message_id) VALUES ('a', :n, :m)",
                {"n": data["amount"], "m": message.id},
            )
        ]

    def applied(self) -> list[str]:
        with self.db.engine.connect() as conn:
            return [r[0] for r in conn.exec_driver_sql(f"SELECT message_id FROM {self.table}")]


class RunnerContract:
    """Subclass and provide a ``harness`` fixture to run the contract on a broker."""

    @pytest.fixture
    def ledger(self, harness: Harness) -> Ledger:
        return Ledger(harness.db)

    def test_a_message_delivered_twice_is_applied_once(
        self, harness: Harness, ledger: Ledger
    ) -> None:
        harness.publish("m-1", body(5))
        harness.publish("m-2", body(7))
        harness.publish("m-1", body(5))
        harness.consume(ledger.behavior)
        assert sorted(ledger.applied()) == ["m-1", "m-2"]
        assert harness.held() == 0

    def test_a_crash_between_commit_and_ack_is_answered_as_duplicate(
        self, harness: Harness, ledger: Ledger
    ) -> None:
        harness.publish("m-1", body(5))
        with pytest.raises(SimulatedCrash):
            harness.consume(ledger.behavior, crash_after_commit=True)
        assert ledger.applied() == ["m-1"]  # committed...
        assert harness.held() == 1  # ...but never acked
        harness.consume(ledger.behavior)  # the restarted consumer
        assert ledger.applied() == ["m-1"]
        assert ledger.calls == ["m-1"]  # the redelivery did not reach the handler
        assert harness.held() == 0

    def test_a_runner_that_dies_mid_batch_loses_nothing(
        self, harness: Harness, ledger: Ledger
    ) -> None:
        # The runner dies in a handler with deliveries fetched, committed or not: the
        # broker must give every one of them to the restarted runner.
        ids = [f"m-{i}" for i in range(6)]
        for mid in ids:
            harness.publish(mid, body(1, die=mid == "m-3"))
        batch_size = 2 if harness.capabilities.batches else 1
        with pytest.raises(SimulatedCrash):
            harness.consume(ledger.behavior, batch_size=batch_size)
        applied = ledger.applied()
        assert "m-3" not in applied
        assert harness.held() == len(ids) - len(applied)
        harness.consume(ledger.behavior, batch_size=batch_size)  # the restarted runner
        assert sorted(ledger.applied()) == ids
        assert harness.held() == 0

    def test_a_runner_that_dies_before_acking_a_batch_loses_nothing(
        self, harness: Harness, ledger: Ledger
    ) -> None:
        ids = [f"m-{i}" for i in range(5)]
        for mid in ids:
            harness.publish(mid, body(1))
        batch_size = 2 if harness.capabilities.batches else 1
        with pytest.raises(SimulatedCrash):
            harness.consume(ledger.behavior, batch_size=batch_size, crash_after_commit=True)
        committed = ledger.applied()
        assert committed and harness.held() == len(ids)  # committed, but nothing acked
        harness.consume(ledger.behavior, batch_size=batch_size)
        assert sorted(ledger.applied()) == ids
        assert sorted(ledger.calls) == ids  # the committed ones came back as DUPLICATE
        assert harness.held() == 0

    def test_either_kind_of_handler_is_driven(self, harness: Harness, ledger: Ledger) -> None:
        # Every runner takes what Deduplicator.handler and AsyncDeduplicator.handler return.
        harness.publish("m-1", body(1))
        harness.publish("m-2", body(2))
        harness.consume(ledger.behavior, asyncio=True)
        harness.publish("m-3", body(3))
        harness.publish("m-1", body(1))
        harness.consume(ledger.behavior, asyncio=False)
        assert sorted(ledger.applied()) == ["m-1", "m-2", "m-3"]
        assert ledger.calls == ["m-1", "m-2", "m-3"]  # the twin of m-1 was a DUPLICATE
        assert harness.held() == 0

    def test_a_message_to_retry_is_not_acked_and_comes_back(
        self, harness: Harness, ledger: Ledger
    ) -> None:
        # More refusals than the in-process attempts: the broker must redeliver it.
        harness.publish("m-1", body(5, retry_times=3))
        harness.publish("m-2", body(7))
        harness.consume(ledger.behavior)
        if harness.capabilities.retry_keeps_order:
            assert ledger.applied() == ["m-1", "m-2"]
        else:
            assert sorted(ledger.applied()) == ["m-1", "m-2"]
        assert ledger.calls.count("m-1") == 4
        assert harness.held() == 0
        assert harness.dead_letters() == []

    def test_a_permanent_failure_is_dead_lettered_and_later_messages_go_on(
        self, harness: Harness, ledger: Ledger
    ) -> None:
        harness.publish("m-1", body(1))
        harness.publish("m-2", body(2, fail="permanent"))
        harness.publish("m-3", body(3))
        harness.consume(ledger.behavior)
        assert sorted(ledger.applied()) == ["m-1", "m-3"]
        [(dead_id, reason)] = harness.dead_letters()
        assert dead_id == "m-2" and "poison: refused by the handler" in reason
        assert harness.held() == 0

    def test_a_malformed_message_is_dead_lettered_not_guessed(
        self, harness: Harness, ledger: Ledger, caplog: pytest.LogCaptureFixture
    ) -> None:
        harness.publish(None, body(1))
        harness.publish("m-2", b"\x00 not json")
        harness.publish("m-3", body(3))
        with caplog.at_level(logging.ERROR, logger="consumerdedup"):
            harness.consume(ledger.behavior)
        assert ledger.applied() == ["m-3"]
        reasons = [reason for _, reason in harness.dead_letters()]
        assert len(reasons) == 2
        assert "InvalidMessage" in reasons[0] and "DecodeError" in reasons[1]
        # One route whatever the broker: the same reason in the hook, the log and the dead letter.
        assert [result.reason for result in harness.told] == reasons
        logged = [record.getMessage() for record in caplog.records]
        assert all(any(f"reason={reason}" in line for line in logged) for reason in reasons)
        assert harness.held() == 0

    def test_a_malformed_message_amid_a_batch_is_dead_lettered_in_its_own_place(
        self, harness: Harness, ledger: Ledger
    ) -> None:
        """A delivery refused before the pipeline sits between two good ones of one batch:
        its FAILED must go to it, not shift onto a neighbour (which would dead-letter m-1
        and ack the refused delivery)."""
        harness.publish("m-1", body(1))
        harness.publish(None, body(2))
        harness.publish("m-3", body(3))
        harness.consume(ledger.behavior, batch_size=3 if harness.capabilities.batches else 1)
        assert ledger.applied() == ["m-1", "m-3"]
        dead = harness.dead_letters()
        assert len(dead) == 1 and dead[0][0] not in {"m-1", "m-3"}, dead
        assert "InvalidMessage" in dead[0][1]
        assert harness.held() == 0

    def test_stop_finishes_the_batch_in_flight_and_loses_nothing(
        self, harness: Harness, ledger: Ledger
    ) -> None:
        total = 40
        for i in range(total):
            harness.publish(f"m-{i:03d}", body(1, slow=0.02))
        stop = harness.start(ledger.behavior, batch_size=4 if harness.capabilities.batches else 1)
        deadline = time.monotonic() + 30
        while len(ledger.applied()) < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        stop()
        applied = ledger.applied()
        assert 8 <= len(applied) < total, "stopped too late to test anything"
        assert harness.held() == total - len(applied)  # every committed message was acked
        harness.consume(ledger.behavior)
        assert sorted(ledger.applied()) == [f"m-{i:03d}" for i in range(total)]
        assert harness.held() == 0

    def test_order_of_one_source_is_kept(self, harness: Harness, ledger: Ledger) -> None:
        ids = [f"m-{i:03d}" for i in range(30)]
        for mid in ids:
            harness.publish(mid, body(1))
        harness.consume(ledger.behavior, batch_size=7 if harness.capabilities.batches else 1)
        handled = [mid for mid in ledger.calls]
        if harness.capabilities.ordered:
            assert handled == ids
        else:
            assert sorted(handled) == ids
        assert harness.held() == 0

    # Bulk handlers (issue 20 item 1): the same promises, one handler call per transaction.

    def test_a_bulk_handler_applies_each_message_once(
        self, harness: Harness, ledger: Ledger
    ) -> None:
        for mid in ("m-1", "m-2", "m-1", "m-3"):
            harness.publish(mid, body(1))
        size = 4 if harness.capabilities.batches else 1
        harness.consume(ledger.behavior, batch_size=size, bulk=True)
        assert sorted(ledger.applied()) == ["m-1", "m-2", "m-3"]
        harness.publish("m-2", body(1))  # a redelivery after the batch committed
        harness.consume(ledger.behavior, batch_size=size, bulk=True, asyncio=True)
        assert sorted(ledger.applied()) == ["m-1", "m-2", "m-3"]
        assert harness.held() == 0

    def test_a_bulk_handlers_poison_fails_alone(self, harness: Harness, ledger: Ledger) -> None:
        ids = [f"m-{i}" for i in range(6)]
        for mid in ids:
            harness.publish(mid, body(1, fail="permanent" if mid == "m-3" else None))
        harness.consume(
            ledger.behavior, batch_size=6 if harness.capabilities.batches else 1, bulk=True
        )
        assert sorted(ledger.applied()) == [mid for mid in ids if mid != "m-3"]
        [(dead_id, reason)] = harness.dead_letters()
        assert dead_id == "m-3" and "poison: refused by the handler" in reason
        assert harness.held() == 0

    def test_a_bulk_handlers_retry_comes_back_and_order_holds(
        self, harness: Harness, ledger: Ledger
    ) -> None:
        ids = [f"m-{i:02d}" for i in range(10)]
        for mid in ids:
            harness.publish(mid, body(1, retry_times=3 if mid == "m-04" else 0))
        harness.consume(
            ledger.behavior, batch_size=5 if harness.capabilities.batches else 1, bulk=True
        )
        assert sorted(ledger.applied()) == ids
        if harness.capabilities.retry_keeps_order:
            assert ledger.applied() == ids  # nothing behind m-04 committed before it
        assert harness.held() == 0
        assert harness.dead_letters() == []
