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
import os
import signal
import threading
import time
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from consumerdedup import CircuitOpen, Message, PermanentError, RetryLater, SimulatedCrash
from tests.contracts.harness import RunnerHarness as Harness
from tests.contracts.harness import ledger_handler, until
from tests.support.tcp_proxy import Proxy


def body(amount: int = 1, **controls: Any) -> bytes:
    return json.dumps({"amount": amount, **controls}).encode()


class Ledger:
    """The business side of every scenario: one row per applied message."""

    def __init__(self, db: Any) -> None:
        self.db = db
        self.table = db.create_ledger()
        self.calls: list[str] = []
        self._lock = threading.Lock()
        self.entered = threading.Event()
        """A handler holding (``hold=True``) has started."""
        self.release = threading.Event()
        """Lets a holding handler go on."""

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
        if data.get("hold") and seen == 1:  # a handler stuck until the test lets it go
            self.entered.set()
            assert self.release.wait(60), "the test never released the handler"
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

    def test_a_handler_failing_every_message_alike_stops_the_runner_and_the_rest_stay(
        self, harness: Harness, ledger: Ledger
    ) -> None:
        """The circuit breaker at its default (10): a broken deploy dead-letters ten, not all."""
        for n in range(1, 15):
            harness.publish(f"m-{n}", body(n, fail="permanent"))
        with pytest.raises(CircuitOpen, match="10 messages in a row failed with"):
            harness.consume(ledger.behavior, batch_size=5)
        assert [dead_id for dead_id, _ in harness.dead_letters()] == [
            f"m-{n}" for n in range(1, 11)
        ]
        assert harness.held() == 4 and ledger.applied() == []
        assert set(ledger.calls) <= {f"m-{n}" for n in range(1, 12)}  # one more tried at most

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

    # The lifecycle contract (its sentences: the second list in consumerdedup/lifecycle.py).

    def test_ready_once_consuming_and_not_after_run_returns(
        self, harness: Harness, ledger: Ledger
    ) -> None:
        runner = harness.fresh(ledger.behavior)
        assert not runner.ready  # not before run(): no start checks passed yet
        running = harness.launch(runner)
        assert until(lambda: runner.ready), "never ready"
        harness.publish("m-1", body(1))
        assert until(lambda: ledger.applied() == ["m-1"])
        running.stop()
        assert not runner.ready
        assert harness.held() == 0

    def test_a_database_away_at_start_is_waited_for(
        self, harness: Harness, ledger: Ledger, caplog: pytest.LogCaptureFixture
    ) -> None:
        if harness.db.dialect != "postgresql":
            # The weaker promise: a file has no server to be away, so the checks pass at once.
            self._checks_pass_at_once(harness, ledger, caplog)
            return
        url = make_url(harness.db.url)
        proxy = Proxy(url.host or "127.0.0.1", url.port or 5432)
        proxy.cut()  # the database is away: every connection refused
        through = url.set(host="127.0.0.1", port=proxy.port)
        engine = create_engine(through, poolclass=NullPool)
        as_async = make_url(harness.db.async_url).set(host="127.0.0.1", port=proxy.port)
        away = replace(harness.db, engine=engine, async_url=as_async.render_as_string(False))
        handler = ledger_handler(
            away, ledger.behavior, harness.told, asyncio=harness.asyncio_by_default
        )
        harness.publish("m-1", body(1))
        runner = harness.runner(handler, batch_size=1, before_ack=None)
        caplog.set_level(logging.WARNING, logger="consumerdedup.lifecycle")
        running = harness.launch(runner)
        try:
            # It retries with backoff and ticks, neither ready nor consuming nor ended.
            tries = lambda: caplog.text.count("database not reachable at start")  # noqa: E731
            assert until(lambda: runner.ready or tries() >= 2, 30), "checks not tried again"
            assert not runner.ready, "ready while its database is away"
            seen = runner.last_tick
            assert until(lambda: runner.last_tick > seen, 10), "no tick while waiting"
            assert not running.wait(0)  # run() still runs
            assert ledger.applied() == [] and harness.held() == 1
            proxy.restore()
            assert until(lambda: runner.ready, 60), "not ready once the database was back"
            assert until(lambda: ledger.applied() == ["m-1"])
        finally:
            running.stop()
            proxy.cut()
            engine.dispose()
        assert harness.held() == 0

    def _checks_pass_at_once(
        self, harness: Harness, ledger: Ledger, caplog: pytest.LogCaptureFixture
    ) -> None:
        harness.publish("m-1", body(1))
        runner = harness.fresh(ledger.behavior)
        caplog.set_level(logging.WARNING, logger="consumerdedup.lifecycle")
        running = harness.launch(runner)
        try:
            assert until(lambda: runner.ready), "not ready on an embedded database"
            assert until(lambda: ledger.applied() == ["m-1"])
            assert "database not reachable at start" not in caplog.text
        finally:
            running.stop()
        assert harness.held() == 0

    def test_the_loop_ticks_while_idle_and_not_while_a_handler_hangs(
        self, harness: Harness, ledger: Ledger
    ) -> None:
        runner = harness.fresh(ledger.behavior)
        running = harness.launch(runner)
        try:
            assert until(lambda: runner.ready)
            # Idle, nothing published: the tick moves all the same; note its longest gap.
            gaps, last = [], runner.last_tick
            while len(gaps) < 5:
                assert until(lambda last=last: runner.last_tick > last, 10), "no tick when idle"
                gaps.append(runner.last_tick - last)
                last = runner.last_tick
            harness.publish("m-1", body(1, hold=True))
            assert ledger.entered.wait(30)
            stuck = runner.last_tick
            # An observation, not a wait for a condition: several idle gaps without a tick.
            time.sleep(max(5 * max(gaps), 0.5))
            assert runner.last_tick == stuck, "the tick moved while the handler hung"
            ledger.release.set()
            assert until(lambda: ledger.applied() == ["m-1"])
            assert until(lambda: runner.last_tick > stuck)
        finally:
            ledger.release.set()
            running.stop()
        assert harness.held() == 0

    def test_stop_from_a_signal_handler_finishes_the_batch_and_loses_nothing(
        self, harness: Harness, ledger: Ledger
    ) -> None:
        """The host's main thread runs the runner (a blocking one itself) and its signal
        handler calls stop(): no lock may be taken there, or the main thread deadlocks."""
        total = 40
        for i in range(total):
            harness.publish(f"m-{i:03d}", body(1, slow=0.02))
        size = 4 if harness.capabilities.batches else 1
        runner = harness.fresh(ledger.behavior, batch_size=size)

        def kill_when_busy() -> None:
            if until(lambda: len(ledger.applied()) >= 8):
                os.kill(os.getpid(), signal.SIGUSR1)

        previous = signal.signal(signal.SIGUSR1, lambda signum, frame: runner.stop())
        killer = threading.Thread(target=kill_when_busy, daemon=True)
        try:
            killer.start()
            harness.run_here(runner)  # returns once the signal's stop() is done
        finally:
            signal.signal(signal.SIGUSR1, previous)
            killer.join(30)
        applied = ledger.applied()
        assert 8 <= len(applied) < total, "stopped too late to test anything"
        assert harness.held() == total - len(applied)  # every committed message was acked
        harness.consume(ledger.behavior)
        assert sorted(ledger.applied()) == [f"m-{i:03d}" for i in range(total)]
        assert harness.held() == 0

    def test_past_the_stop_deadline_nothing_more_is_acked(
        self, harness: Harness, ledger: Ledger
    ) -> None:
        harness.publish("m-1", body(1, hold=True))
        harness.publish("m-2", body(2))
        running = harness.launch(harness.fresh(ledger.behavior))
        assert ledger.entered.wait(30)
        running.runner.stop(deadline=0.0)  # the deadline is now, the handler still hangs
        ledger.release.set()
        assert running.wait(30), "run() did not return after its deadline"
        assert ledger.applied() in ([], ["m-1"])  # committed or rolled back...
        assert harness.held() == 2  # ...but not acked, and m-2 was not taken
        harness.consume(ledger.behavior)
        assert sorted(ledger.applied()) == ["m-1", "m-2"]  # each once
        assert harness.held() == 0

    def test_run_installs_no_signal_handler(self, harness: Harness, ledger: Ledger) -> None:
        watched = (signal.SIGTERM, signal.SIGINT)
        before = [signal.getsignal(sig) for sig in watched]
        runner = harness.fresh(ledger.behavior)
        running = harness.launch(runner)
        assert until(lambda: runner.ready)
        assert [signal.getsignal(sig) for sig in watched] == before  # the host keeps its own
        running.stop()
        assert [signal.getsignal(sig) for sig in watched] == before
