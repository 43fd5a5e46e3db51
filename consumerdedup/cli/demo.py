"""The embedded demo: a payments consumer on SQLite and the in-memory broker, under fire.

Payments credit accounts, and each credit emits an event through the outbox
that a downstream consumer turns into a notification. The broker redelivers
acked messages at random (as after a lost ack or a rebalance), the producer
retries some publishes, the consumer is killed between commit and ack several
times and restarted, the relay is killed once after a broker confirmation, and
the stream carries a malformed message, an unknown account and a reused id.

The report says what was sent, what the broker delivered, what the consumer
did with each delivery, and what a consumer without deduplication would have
credited; every group of counts adds up to its total. At the end every
balance must be exactly the sum of the distinct payments. The stream and its
faults are demo_scenario's, the report's words demo_report's; this module runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import random
import sys
import tempfile
from collections import Counter
from functools import partial
from pathlib import Path
from typing import TextIO

from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session

from ..dedup.deduplicator import DedupHandler, Deduplicator
from ..errors import PermanentError, SimulatedCrash
from ..message import Message
from ..outbox.outbox import Outbox
from ..outbox.relay import OutboxRelay
from ..outcome import Outcome
from ..schema import install
from ..testing import MemoryBroker, MemoryConfig, MemoryConsumerRunner
from .demo_report import Stage, check, events_lines, payments_lines, without_dedup_lines
from .demo_scenario import (
    ACCOUNTS,
    CRASHES,
    EVENTS,
    PAYMENTS,
    QUEUE,
    RELAY_DIES_AFTER,
    DiesOnce,
    WithoutDedup,
    is_offset,
    publish,
)

NAME = "demo"
HELP = "run the embedded demo (SQLite and an in-memory broker)"


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
    sent = publish(broker, rng)
    for n in sorted(rng.sample(range(PAYMENTS), CRASHES)):
        broker.crash_before_ack(partial(is_offset, n))

    outbox = Outbox()
    naive = WithoutDedup()
    ledger = Deduplicator(engine, consumer="ledger", observers=[naive])

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

    payments = _stage(broker, QUEUE, credit)
    dead_letters = broker.messages(QUEUE + ".dlq")

    # The relay dies once right after the broker confirmed a few events, before
    # marking them published: they go out twice, and the downstream dedups them.
    before = broker.published
    with contextlib.suppress(SimulatedCrash):
        OutboxRelay(engine, DiesOnce(broker, after=RELAY_DIES_AFTER)).drain()
    OutboxRelay(engine, broker).drain()
    relayed = broker.published - before

    notifications = Deduplicator(engine, consumer="notifications")

    @notifications.handler
    def notify(message: Message, session: Session) -> None:
        session.execute(text("INSERT INTO notifications VALUES (:id)"), {"id": message.id})

    downstream = _stage(broker, EVENTS, notify)
    balances, events, notified = _read(engine)
    lines = [
        "consumerdedup demo: a payments consumer on SQLite and an in-memory broker, under fire",
        *payments_lines(sent, payments, dead_letters),
        *without_dedup_lines(naive, sent, payments),
        *events_lines(events, relayed, downstream),
    ]
    failures = check(sent.expected, balances, payments.outcomes, downstream.outcomes, notified)
    lines += [f"FAIL: {failure}" for failure in failures] or [
        f"OK: all {len(ACCOUNTS)} account balances are exact (total "
        f"{sum(balances.values()):,}): every payment applied exactly once",
        f"OK: {notified:,} notifications for {PAYMENTS:,} credits: every event handled once",
    ]
    out.write("\n".join(lines) + "\n")
    return 1 if failures else 0


def _read(engine: Engine) -> tuple[dict[str, int], int, int]:
    """The balances, the outbox rows the credits wrote, and the notifications made."""
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT id, balance FROM accounts")).all()
        balances: dict[str, int] = {account: balance for account, balance in rows}
        events = conn.execute(text("SELECT count(*) FROM outbox")).scalar_one()
        notified = conn.execute(text("SELECT count(*) FROM notifications")).scalar_one()
    engine.dispose()
    return balances, events, notified


def _stage(broker: MemoryBroker, queue: str, handler: DedupHandler) -> Stage:
    """Run consumers until the queue is empty, restarting each one that crashes."""
    delivered, again = broker.delivered, broker.redelivered
    restarts = 0
    outcomes: Counter[Outcome] = Counter()
    while True:
        runner = MemoryConsumerRunner(
            handler, queue, broker=broker, config=MemoryConfig(batch_size=10)
        )
        try:
            runner.run(until_idle=True)
        except SimulatedCrash:
            restarts += 1  # the process died after COMMIT, before ACK; a supervisor restarts it
            continue
        finally:
            outcomes.update(runner.outcomes)
        break
    return Stage(
        deliveries=broker.delivered - delivered,
        again=broker.redelivered - again,
        outcomes=outcomes,
        restarts=restarts,
    )
