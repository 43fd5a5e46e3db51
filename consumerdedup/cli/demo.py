"""The embedded demo: a payments consumer on SQLite and the in-memory broker, under fire.

Payments credit accounts, and each credit emits an event through the outbox
that a downstream consumer turns into a notification. The broker redelivers
acked messages at random (as after a lost ack or a rebalance), the producer
retries some publishes, the consumer is killed between commit and ack several
times and restarted, the relay is killed once after a broker confirmation, and
the stream carries a malformed message and a reused id. At the end every
balance must be exactly the sum of the distinct payments.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import random
import sys
import tempfile
from collections import Counter, defaultdict
from functools import partial
from pathlib import Path
from typing import Any, TextIO

from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from ..dedup.deduplicator import DedupHandler, Deduplicator
from ..errors import PermanentError, SimulatedCrash
from ..headers import REASON_HEADER
from ..message import Message
from ..outbox.outbox import Outbox
from ..outbox.publisher import Publisher
from ..outbox.relay import OutboxRelay
from ..outcome import Outcome
from ..schema import install
from ..testing import MemoryBroker, MemoryConsumerRunner
from ..testing.memory_broker import Delivery

NAME = "demo"
HELP = "run the embedded demo (SQLite and an in-memory broker)"

QUEUE = "payments"
EVENTS = "account-events"
ACCOUNTS = [f"ACC-{n:03d}" for n in range(1, 21)]
PAYMENTS = 1_000
CRASHES = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo takes no options of its own."""


def run(args: argparse.Namespace) -> int:
    return play(sys.stdout)


def play(out: TextIO) -> int:
    """Run the demo, write its report to ``out``; 0 if every balance came out exact."""
    # The report lists the dead letters; the per-message error log would repeat them.
    log = logging.getLogger("consumerdedup")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        with tempfile.TemporaryDirectory(prefix="consumerdedup-demo-") as folder:
            return _run(Path(folder) / "demo.db", out)
    finally:
        log.setLevel(level)


def _run(path: Path, out: TextIO) -> int:
    engine = create_engine(f"sqlite:///{path}")
    install(engine)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE accounts (id TEXT PRIMARY KEY, balance INTEGER NOT NULL)"))
        conn.execute(text("INSERT INTO accounts VALUES (:id, 0)"), [{"id": a} for a in ACCOUNTS])
        conn.execute(text("CREATE TABLE notifications (event_id TEXT NOT NULL)"))

    rng = random.Random(2026)
    broker = MemoryBroker(duplicate_rate=0.15, seed=7)
    expected = _publish(broker, rng)
    crash_points = set(rng.sample(range(PAYMENTS), CRASHES))
    for n in sorted(crash_points):
        broker.crash_before_ack(partial(_is_offset, n))

    outbox = Outbox()
    ledger = Deduplicator(engine, consumer="ledger")

    @ledger.handler
    def credit(message: Message, session: Session) -> None:
        payment = message.json()
        if payment.get("account") not in ACCOUNTS:
            raise PermanentError(f"unknown account {payment.get('account')!r}")
        session.execute(
            text("UPDATE accounts SET balance = balance + :amount WHERE id = :account"),
            payment,
        )
        # Emitted in the same transaction: the event exists if and only if the credit does.
        outbox.add(session, EVENTS, message.body, key=payment["account"])

    outcomes, restarts = _consume(broker, QUEUE, credit)
    first_stage = (broker.published, broker.delivered, broker.redelivered)

    # The relay dies once right after the broker confirmed a few events, before
    # marking them published: they go out twice, and the downstream dedups them.
    dying = _DiesOnce(broker, after=5)
    with contextlib.suppress(SimulatedCrash):
        OutboxRelay(engine, dying).drain()
    OutboxRelay(engine, broker).drain()

    notifications = Deduplicator(engine, consumer="notifications")

    @notifications.handler
    def notify(message: Message, session: Session) -> None:
        session.execute(text("INSERT INTO notifications VALUES (:id)"), {"id": message.id})

    downstream, _ = _consume(broker, EVENTS, notify)

    with engine.connect() as conn:
        rows = conn.execute(text("SELECT id, balance FROM accounts")).tuples()
        balances: dict[str, int] = dict(rows.all())
        records = conn.execute(text("SELECT count(*) FROM processed_events")).scalar()
        sent = conn.execute(text("SELECT count(*) FROM notifications")).scalar_one()
    engine.dispose()
    published, delivered, redelivered = first_stage
    lines = [
        "consumerdedup demo: payments consumer on SQLite + in-memory broker",
        "",
        f"  payments published            {PAYMENTS:>6}",
        f"    + producer retries, bad     {published - PAYMENTS:>6}",
        f"  deliveries                    {delivered:>6}",
        f"    redelivered                 {redelivered:>6}",
        f"  crashes between commit & ack  {restarts:>6}  (consumer restarted each time)",
        f"  processed (handler ran)       {outcomes[Outcome.PROCESSED]:>6}",
        f"  duplicates skipped            {outcomes[Outcome.DUPLICATE]:>6}",
        f"  failed -> dead-letter queue   {outcomes[Outcome.FAILED]:>6}",
        f"  dedup records (2 consumers)   {records!s:>6}",
        "",
        "  dead letters:",
        *(f"    {m.id}: {m.headers.get(REASON_HEADER)}" for m in broker.messages(QUEUE + ".dlq")),
        "",
        "  outbox: each credit emitted an event in the same transaction as the credit",
        f"  events published by the relay {broker.published - published:>6}  "
        "(relay killed once after a confirm: some went twice)",
        f"  notifications sent downstream {downstream[Outcome.PROCESSED]:>6}",
        f"    duplicates skipped          {downstream[Outcome.DUPLICATE]:>6}",
        "",
    ]
    failures = _check(expected, balances, outcomes, downstream, sent)
    lines += [f"  FAIL: {failure}" for failure in failures] or [
        f"  OK: all {len(ACCOUNTS)} account balances are exact (total {sum(balances.values())}):"
        " every payment applied exactly once",
        f"  OK: {sent} notifications for {PAYMENTS} credits: every event handled exactly once",
    ]
    out.write("\n".join(lines) + "\n")
    return 1 if failures else 0


def _check(
    expected: dict[str, int],
    balances: dict[str, int],
    outcomes: Counter[Outcome],
    downstream: Counter[Outcome],
    sent: int,
) -> list[str]:
    failures = []
    wrong = {a: (balances[a], expected[a]) for a in ACCOUNTS if balances[a] != expected[a]}
    if wrong:
        failures.append(f"{len(wrong)} balances are wrong (actual, expected): {wrong}")
    if outcomes[Outcome.PROCESSED] != PAYMENTS:
        failures.append(f"{outcomes[Outcome.PROCESSED]} payments processed, not {PAYMENTS}")
    if sent != PAYMENTS or downstream[Outcome.PROCESSED] != PAYMENTS:
        failures.append(f"{sent} notifications for {PAYMENTS} credits")
    return failures


def _consume(
    broker: MemoryBroker, queue: str, handler: DedupHandler
) -> tuple[Counter[Outcome], int]:
    """Run consumers until the queue is empty, restarting each one that crashes."""
    restarts = 0
    outcomes: Counter[Outcome] = Counter()
    while True:
        runner = MemoryConsumerRunner(broker, queue, handler, batch_size=10)
        try:
            runner.run(until_idle=True)
        except SimulatedCrash:
            restarts += 1  # the process died after COMMIT, before ACK; a supervisor restarts it
            continue
        finally:
            outcomes.update(runner.outcomes)
        return outcomes, restarts


class _DiesOnce(Publisher):
    """A publisher that dies after ``after`` confirmed publishes, before the relay can mark them."""

    def __init__(self, broker: MemoryBroker, after: int) -> None:
        self.broker = broker
        self.after = after
        self.published = 0

    def publish(
        self, destination: str, body: bytes, key: str | None = None, headers: Any = None
    ) -> None:
        self.broker.publish(destination, body, key, headers)
        self.published += 1
        if self.published == self.after:
            raise SimulatedCrash("relay killed after the broker confirmed")


def _is_offset(offset: int, delivery: Delivery) -> bool:
    return delivery.offset == offset


def _publish(broker: MemoryBroker, rng: random.Random) -> dict[str, int]:
    """Publish the payments, with producer retries, a poison message and a reused id."""
    expected: dict[str, int] = defaultdict(int)
    for n in range(PAYMENTS):
        account, amount = rng.choice(ACCOUNTS), rng.randint(1, 500)
        body = json.dumps({"account": account, "amount": amount}).encode()
        copies = 2 if rng.random() < 0.05 else 1  # the producer retried after a timeout
        for _ in range(copies):
            broker.publish(QUEUE, body, message_id=f"pay-{n:05d}")
        expected[account] += amount
    broker.publish(QUEUE, b"{not json", message_id="pay-malformed")
    broker.publish(QUEUE, b'{"account": "ACC-999", "amount": 5}', message_id="pay-unknown")
    # A buggy producer reuses an id for a different payment: reported, never applied.
    broker.publish(QUEUE, b'{"account": "ACC-001", "amount": 1000000}', message_id="pay-00000")
    return expected
