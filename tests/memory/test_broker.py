"""MemoryBroker's at-least-once semantics and fault injection, and MemoryConsumerRunner."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import timedelta

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from consumerdedup import (
    Deduplicator,
    Message,
    Outcome,
    PermanentError,
    RetryLater,
    RetryPolicy,
    SimulatedCrash,
)
from consumerdedup.testing import MemoryBroker, MemoryConfig, MemoryConsumerRunner
from consumerdedup.testing.memory_broker import CONSUMER_HEADER, REASON_HEADER, Delivery
from tests.conftest import Database
from tests.core.test_lifecycle import MARGIN

ONE_TRY = RetryPolicy(attempts=1, initial_delay=timedelta(0), max_delay=timedelta(0))


def ids(deliveries: Sequence[Delivery]) -> list[str | None]:
    return [d.message_id for d in deliveries]


def filled(count: int, *, duplicate_rate: float = 0.0, seed: int = 0) -> MemoryBroker:
    broker = MemoryBroker(duplicate_rate=duplicate_rate, seed=seed)
    for n in range(count):
        broker.publish("q", f"body-{n}".encode(), message_id=f"m{n}")
    return broker


def drain(broker: MemoryBroker, source: str = "q", consumer: str = "c") -> list[Delivery]:
    """Fetch and ack until the source is empty; every delivery handed out, in order."""
    seen: list[Delivery] = []
    while batch := broker.fetch(source, 10, consumer=consumer):
        for delivery in batch:
            broker.ack(delivery)
            seen.append(delivery)
    return seen


# Order, holding, ack and nack


def test_fifo_order_and_offsets() -> None:
    broker = filled(50)
    got: list[Delivery] = []
    while batch := broker.fetch("q", 7):
        got += batch
        for delivery in batch:
            broker.ack(delivery)
    assert ids(got) == [f"m{n}" for n in range(50)]
    assert [d.offset for d in got] == list(range(50))
    assert [d.body for d in got[:2]] == [b"body-0", b"body-1"]
    assert not any(d.redelivered for d in got)
    assert len({d.tag for d in got}) == 50


def test_id_comes_from_the_event_id_header_or_message_id() -> None:
    broker = MemoryBroker()
    broker.publish("q", b"a", headers={"event_id": "from-header", "h": "v"})
    broker.publish("q", b"b", message_id="from-arg")
    broker.publish("q", b"c")
    first, second, third = broker.fetch("q", 3)
    assert (first.message_id, first.headers["h"]) == ("from-header", "v")
    assert second.message_id == "from-arg" and second.headers["event_id"] == "from-arg"
    assert third.message_id is None
    message = first.to_message()
    assert (message.id, message.body, message.source, message.offset) == (
        "from-header",
        b"a",
        "q",
        0,
    )
    assert message.raw is first


def test_unacked_messages_are_held_until_acked() -> None:
    broker = filled(3)
    broker.publish("other", b"x", message_id="o1")
    assert broker.held("q") == 3
    fetched = broker.fetch("q", 2)
    assert broker.held("q") == 3  # fetched but not acked: still the broker's
    assert ids(broker.fetch("q", 5)) == ["m2"]  # but not handed out twice
    broker.ack(fetched[0])
    assert broker.held("q") == 2
    broker.nack(fetched[1])
    assert broker.held("q") == 2
    assert broker.held("other") == 1
    assert broker.acked == 1


def test_ack_removes_for_good() -> None:
    broker = filled(2)
    for delivery in broker.fetch("q", 2):
        broker.ack(delivery)
    assert broker.held("q") == 0
    assert broker.fetch("q", 10) == []
    broker.crash("c")
    broker.crash("consumer")
    assert broker.fetch("q", 10) == []  # a crash does not bring back what was acked


def test_nack_puts_back_at_the_front_in_order() -> None:
    broker = filled(5)
    batch = broker.fetch("q", 3)
    for delivery in reversed(batch):  # as a runner gives back a batch
        broker.nack(delivery)
    again = broker.fetch("q", 10)
    assert ids(again) == ["m0", "m1", "m2", "m3", "m4"]
    assert [d.redelivered for d in again] == [True, True, True, False, False]


def test_single_nack_goes_ahead_of_later_messages() -> None:
    broker = filled(3)
    first = broker.fetch("q")[0]
    broker.nack(first)
    assert ids(broker.fetch("q", 10)) == ["m0", "m1", "m2"]


# Crashes


def test_crash_requeues_only_that_consumers_unacked_in_order() -> None:
    broker = filled(8)
    a = broker.fetch("q", 4, consumer="a")  # m0..m3
    b = broker.fetch("q", 2, consumer="b")  # m4, m5
    broker.ack(a[1])
    broker.crash("a")
    assert broker.held("q") == 7
    # a's unacked come back first, in their original order; b keeps its deliveries.
    again = broker.fetch("q", 10, consumer="c")
    assert ids(again) == ["m0", "m2", "m3", "m6", "m7"]
    assert [d.redelivered for d in again] == [True, True, True, False, False]
    assert [d.offset for d in again] == [0, 2, 3, 6, 7]
    for delivery in b:
        broker.ack(delivery)  # b's tags are still valid
    for delivery in again:
        broker.ack(delivery)
    assert broker.held("q") == 0


def test_crash_before_ack_raises_and_requeues_that_consumer() -> None:
    broker = filled(6)
    a = broker.fetch("q", 3, consumer="a")  # m0, m1, m2
    b = broker.fetch("q", 2, consumer="b")  # m3, m4
    broker.ack(a[0])
    broker.crash_before_ack()
    with pytest.raises(SimulatedCrash):
        broker.ack(a[1])
    assert broker.crashes_injected == 1
    assert broker.held("q") == 5  # the crashed ack did not settle m1
    broker.ack(b[0])  # the crash fires once, and only for the consumer that acked
    broker.ack(b[1])
    again = broker.fetch("q", 10, consumer="c")
    assert ids(again) == ["m1", "m2", "m5"]
    assert [d.redelivered for d in again] == [True, True, False]


def test_crash_before_ack_with_a_condition() -> None:
    broker = filled(3)
    batch = broker.fetch("q", 3, consumer="a")
    broker.crash_before_ack(lambda delivery: delivery.message_id == "m1")
    broker.ack(batch[0])
    with pytest.raises(SimulatedCrash, match="m1"):
        broker.ack(batch[1])
    assert ids(broker.fetch("q", 10)) == ["m1", "m2"]


def test_simulated_crash_is_not_an_exception() -> None:
    assert issubclass(SimulatedCrash, BaseException)
    assert not issubclass(SimulatedCrash, Exception)
    broker = filled(1)
    delivery = broker.fetch("q")[0]
    broker.crash_before_ack()
    with pytest.raises(SimulatedCrash):
        try:
            broker.ack(delivery)
        except Exception:  # what a handler's or runner's catch-all would do
            pytest.fail("except Exception swallowed the simulated crash")


# Injected duplicates


def test_duplicate_rate_redelivers_acked_messages() -> None:
    broker = filled(1000, duplicate_rate=0.2, seed=7)
    seen = drain(broker)
    injected = broker.duplicates_injected
    # Each ack is duplicated with p=0.2, duplicates included: about 1000 * 0.2 / 0.8 = 250.
    assert 180 <= injected <= 330
    assert len(seen) == 1000 + injected
    assert set(ids(seen)) == {f"m{n}" for n in range(1000)}
    redelivered = [d for d in seen if d.redelivered]
    assert len(redelivered) == injected == broker.redelivered
    first_seen: dict[str | None, int] = {}
    for position, delivery in enumerate(seen):
        first_seen.setdefault(delivery.message_id, position)
        # A redelivery is of a message delivered (and acked) earlier, same body.
        assert delivery.redelivered == (first_seen[delivery.message_id] < position)
    assert broker.held("q") == 0


def test_duplicate_rate_is_deterministic_per_seed() -> None:
    def injected(seed: int) -> list[str | None]:
        broker = filled(300, duplicate_rate=0.3, seed=seed)
        return [d.message_id for d in drain(broker) if d.redelivered]

    assert injected(1) == injected(1)
    assert len({tuple(injected(seed)) for seed in range(5)}) > 1


def test_no_duplicates_by_default() -> None:
    broker = filled(200)
    assert len(drain(broker)) == 200
    assert broker.duplicates_injected == 0


@pytest.mark.parametrize("rate", [-0.1, 1.0, 2.0])
def test_duplicate_rate_out_of_range(rate: float) -> None:
    with pytest.raises(ValueError, match="duplicate_rate"):
        MemoryBroker(duplicate_rate=rate)


# Dead letters


def test_dead_letter_copies_to_dlq_with_reason_and_event_id() -> None:
    broker = MemoryBroker()
    broker.publish("payments", b"poison", headers={"trace": "t-1"}, message_id="e-1")
    delivery = broker.fetch("payments")[0]
    broker.dead_letter(delivery, "PermanentError: refused", consumer="ledger")
    broker.ack(delivery)

    assert broker.held("payments") == 0
    (dead,) = broker.messages("payments.dlq")
    assert dead.id == "e-1"
    assert dead.body == b"poison"
    assert dead.source == "payments.dlq"
    assert dead.headers[REASON_HEADER] == "PermanentError: refused"
    assert dead.headers[CONSUMER_HEADER] == "ledger"
    assert dead.headers["event_id"] == "e-1"
    assert dead.headers["trace"] == "t-1"
    # messages() only looks; the dead letter is still there to be consumed.
    assert ids(broker.fetch("payments.dlq")) == ["e-1"]


# Blocking fetch and threads


def test_fetch_with_timeout_wakes_up_on_publish() -> None:
    broker = MemoryBroker()
    got: list[Delivery] = []

    def consume() -> None:
        got.extend(broker.fetch("q", 5, timeout=10))

    consumer = threading.Thread(target=consume)
    consumer.start()
    time.sleep(0.1)
    assert consumer.is_alive()  # waiting, not returned empty
    broker.publish("q", b"x", message_id="late")
    published = time.monotonic()
    consumer.join(5)
    assert not consumer.is_alive()
    assert time.monotonic() - published < MARGIN  # woken by the publish, not the timeout
    assert ids(got) == ["late"]


def test_fetch_with_timeout_returns_empty_after_the_timeout() -> None:
    broker = MemoryBroker()
    started = time.monotonic()
    assert broker.fetch("q", timeout=0.1) == []
    assert 0.09 <= time.monotonic() - started < 0.1 + MARGIN


def test_concurrent_consumers_ack_each_message_exactly_once() -> None:
    total, workers = 2000, 4
    broker = MemoryBroker()
    published = threading.Event()
    acked: list[list[str | None]] = [[] for _ in range(workers)]
    errors: list[BaseException] = []
    # Each consumer holds its first batch, unacked, until every consumer has one: all four
    # take turns by construction (left to the scheduler, one thread could drain the queue).
    all_served = threading.Barrier(workers, timeout=60)  # the timeout is a hang guard

    def produce() -> None:
        for n in range(total):
            broker.publish("q", b"x", message_id=f"m{n}")
        published.set()

    def consume(worker: int) -> None:
        try:
            while True:
                batch = broker.fetch("q", 1 + worker * 3, consumer=f"w{worker}", timeout=0.01)
                if not batch and published.is_set() and broker.held("q") == 0:
                    return
                if batch and not acked[worker]:
                    all_served.wait()
                for delivery in batch:
                    broker.ack(delivery)
                    acked[worker].append(delivery.message_id)
        except BaseException as exc:
            errors.append(exc)

    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # interleave the threads as much as possible
    try:
        threads = [threading.Thread(target=consume, args=(w,)) for w in range(workers)]
        threads.append(threading.Thread(target=produce))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        sys.setswitchinterval(previous)

    assert errors == []
    assert not any(thread.is_alive() for thread in threads)
    counts = Counter(mid for per_worker in acked for mid in per_worker)
    assert len(counts) == total and set(counts.values()) == {1}
    assert all(acked), "every consumer met the others with a batch in hand"
    for per_worker in acked:  # one queue, FIFO: each consumer sees increasing offsets
        numbers = [int(str(mid)[1:]) for mid in per_worker]
        assert numbers == sorted(numbers)
    assert broker.held("q") == 0
    assert broker.acked == broker.delivered == broker.published == total


# MemoryConsumerRunner on a real database


class Ledger:
    """A handler writing one ledger row per message; the body can ask for failures."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.table = db.create_ledger()
        self.calls: list[tuple[str, bool]] = []
        self.during_call: Callable[[Message], None] = lambda message: None

    def __call__(self, message: Message, session: Session) -> None:
        delivery: Delivery = message.raw
        self.calls.append((str(message.id), delivery.redelivered))
        self.during_call(message)
        data = message.json()
        if data.get("fail"):
            raise PermanentError("refused by the handler")
        if self.tries(message.id) <= data.get("retry_times", 0):
            raise RetryLater("not yet")
        session.execute(
            text(f"INSERT INTO {self.table} (account, amount, message_id) VALUES ('a', 1, :m)"),
            {"m": message.id},
        )

    def tries(self, message_id: object) -> int:
        return sum(1 for mid, _ in self.calls if mid == message_id)

    def rows(self) -> list[str]:
        with self.db.engine.connect() as conn:
            sql = f"SELECT message_id FROM {self.table} ORDER BY message_id"
            return [row[0] for row in conn.exec_driver_sql(sql)]


def runner_for(
    db: Database,
    broker: MemoryBroker,
    ledger: Ledger,
    batch_size: int = 1,
    poll_timeout: timedelta = timedelta(milliseconds=500),
) -> MemoryConsumerRunner:
    dedup = Deduplicator(db.engine, consumer="ledger", tables=db.tables, retry=ONE_TRY)
    config = MemoryConfig(
        batch_size=batch_size, poll_timeout=poll_timeout, retry_delay=timedelta(0)
    )
    return MemoryConsumerRunner(dedup.handler(ledger), "payments", broker=broker, config=config)


def body(**controls: object) -> bytes:
    return json.dumps(controls).encode()


def test_runner_drains_the_queue_and_counts_outcomes(db: Database) -> None:
    broker = MemoryBroker()
    ledger = Ledger(db)
    for n in range(7):
        broker.publish("payments", body(), message_id=f"p{n}")
    broker.publish("payments", body(), message_id="p1")  # a duplicate
    broker.publish("payments", body(), message_id="p4")  # another
    broker.publish("payments", body(fail=True), message_id="bad")
    broker.publish("payments", body())  # no id: dead-lettered, never guessed

    runner = runner_for(db, broker, ledger, batch_size=3)
    runner.run(until_idle=True)

    assert ledger.rows() == [f"p{n}" for n in range(7)]
    assert broker.held("payments") == 0
    assert runner.outcomes == Counter(
        {Outcome.PROCESSED: 7, Outcome.DUPLICATE: 2, Outcome.FAILED: 2}
    )
    assert broker.acked == 11
    dead = broker.messages("payments.dlq")
    assert [m.id for m in dead] == ["bad", None]
    assert "refused by the handler" in dead[0].headers[REASON_HEADER]
    assert "InvalidMessage" in dead[1].headers[REASON_HEADER]


def test_runner_gives_retry_outcomes_back_and_they_come_again(db: Database) -> None:
    broker = MemoryBroker()
    ledger = Ledger(db)
    broker.publish("payments", body(retry_times=2), message_id="p0")
    broker.publish("payments", body(), message_id="p1")

    runner = runner_for(db, broker, ledger)
    runner.run(until_idle=True)

    # Not acked, delivered again, ahead of the next message: the order holds.
    assert ledger.calls == [("p0", False), ("p0", True), ("p0", True), ("p1", False)]
    assert runner.outcomes == Counter({Outcome.RETRY: 2, Outcome.PROCESSED: 2})
    assert ledger.rows() == ["p0", "p1"]
    assert broker.held("payments") == 0
    assert broker.acked == 2 and broker.delivered == 4


def test_runner_retry_in_a_batch_only_gives_back_that_message(db: Database) -> None:
    broker = MemoryBroker()
    ledger = Ledger(db)
    broker.publish("payments", body(), message_id="p0")
    broker.publish("payments", body(retry_times=1), message_id="p1")
    broker.publish("payments", body(), message_id="p2")

    runner = runner_for(db, broker, ledger, batch_size=3)
    runner.run(until_idle=True)

    assert runner.outcomes == Counter({Outcome.PROCESSED: 3, Outcome.RETRY: 1})
    # p1's failure rolls back the optimistic pass; p0 and p2 are redone with savepoints,
    # then p1 comes back from the broker alone.
    assert [mid for mid, _ in ledger.calls] == ["p0", "p1", "p0", "p2", "p1"]
    assert ledger.rows() == ["p0", "p1", "p2"]
    assert broker.held("payments") == 0


def test_runner_gives_several_retries_back_in_their_order(db: Database) -> None:
    broker = MemoryBroker()
    ledger = Ledger(db)
    for n, retries in enumerate([1, 0, 1, 1, 0]):
        broker.publish("payments", body(retry_times=retries), message_id=f"p{n}")

    runner = runner_for(db, broker, ledger, batch_size=5)
    runner.run(until_idle=True)

    # First round: p0's RetryLater uses up its one attempt; p1 commits without it; p2's same
    # RetryLater then gives up the rest untried (a recurring transient failure is not tried one
    # by one: the batch's time is bounded), so p3 and p4 come back untouched, in their order.
    first_round = [mid for mid, again in ledger.calls if not again]
    assert first_round == ["p0", "p1", "p2", "p1"]
    # Redelivered in publish order: p0 and p2 now pass, p3 asks once more, p4 commits with the
    # prefix, and p3 comes back last, alone.
    second_round = [mid for mid, again in ledger.calls if again]
    assert second_round == ["p0", "p2", "p3", "p0", "p2", "p4", "p3"]
    assert runner.outcomes == Counter({Outcome.PROCESSED: 5, Outcome.RETRY: 5})
    assert ledger.rows() == [f"p{n}" for n in range(5)]


def test_stop_from_another_thread_makes_run_return(db: Database) -> None:
    broker = MemoryBroker()
    ledger = Ledger(db)
    runner = runner_for(db, broker, ledger, poll_timeout=timedelta(milliseconds=20))
    worker = threading.Thread(target=runner.run, daemon=True)
    worker.start()

    for n in range(3):  # published while it runs: it keeps consuming, not only until idle
        broker.publish("payments", body(), message_id=f"p{n}")
    deadline = time.monotonic() + 10
    while broker.held("payments") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.is_alive()  # idle, but still waiting for more

    started = time.monotonic()
    runner.stop()
    worker.join(5)
    assert not worker.is_alive()
    poll_timeout = runner.config.poll_timeout.total_seconds()
    assert time.monotonic() - started < poll_timeout + MARGIN  # its fetch's wait
    assert ledger.rows() == ["p0", "p1", "p2"]
    assert runner.outcomes == Counter({Outcome.PROCESSED: 3})
    broker.publish("payments", body(), message_id="late")
    time.sleep(0.05)
    assert broker.held("payments") == 1  # nothing consumes after stop


def test_sigterm_finishes_the_batch_in_flight_then_run_returns(db: Database) -> None:
    assert threading.current_thread() is threading.main_thread()
    broker = MemoryBroker()
    ledger = Ledger(db)
    for n in range(6):
        broker.publish("payments", body(), message_id=f"p{n}")
    runner = runner_for(db, broker, ledger, batch_size=3)
    in_flight, done = threading.Event(), threading.Event()
    stop_seen_in_flight: list[bool] = []

    def hold_first_message(message: Message) -> None:
        if message.id != "p0":
            return
        in_flight.set()
        deadline = time.monotonic() + 10
        while not runner.stopping and time.monotonic() < deadline:
            time.sleep(0.005)  # the main thread runs the signal handler between these
        stop_seen_in_flight.append(runner.stopping)

    signal_ignored: list[bool] = []

    def send_sigterm() -> None:
        if in_flight.wait(10):
            time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGTERM)
        if not in_flight.is_set() or not done.wait(10):
            signal_ignored.append(True)
            runner.stop()  # fail the test below rather than hang it

    ledger.during_call = hold_first_message
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    sender = threading.Thread(target=send_sigterm, daemon=True)
    unhandled: list[int] = []
    try:
        # Were on_signals to install nothing, this records the signal instead of dying of it.
        signal.signal(signal.SIGTERM, lambda signum, frame: unhandled.append(signum))
        runner.on_signals()
        sender.start()
        runner.run()  # returns only if the signal stopped it
        done.set()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sender.join(5)

    assert unhandled == [] and signal_ignored == []
    assert stop_seen_in_flight == [True]
    # The batch in flight finished, committed and was acked; nothing after it was taken.
    assert ledger.rows() == ["p0", "p1", "p2"]
    assert runner.outcomes == Counter({Outcome.PROCESSED: 3})
    assert broker.acked == 3
    assert broker.held("payments") == 3
    assert ids(broker.fetch("payments", 10)) == ["p3", "p4", "p5"]
