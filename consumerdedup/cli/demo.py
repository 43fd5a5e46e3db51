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
balance must be exactly the sum of the distinct payments.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import random
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TextIO

from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session

from ..dedup.deduplicator import DedupHandler, Deduplicator
from ..errors import PermanentError, SimulatedCrash
from ..headers import REASON_HEADER
from ..message import Message
from ..outbox.outbox import Outbox
from ..outbox.relay import OutboxRelay
from ..outcome import Outcome
from ..schema import install
from ..testing import MemoryBroker, MemoryConfig, MemoryConsumerRunner
from .demo_scenario import (
    ACCOUNTS,
    BAD,
    CRASHES,
    EVENTS,
    PAYMENTS,
    QUEUE,
    RELAY_DIES_AFTER,
    REUSED_AMOUNT,
    DiesOnce,
    Sent,
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


@dataclass
class _Stage:
    """The broker's counters over one consumer's run, and what the consumer decided."""

    deliveries: int
    again: int
    outcomes: Counter[Outcome]
    restarts: int


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
        *_report_payments(sent, payments, dead_letters),
        *_report_without(naive, sent, payments),
        *_report_events(events, relayed, downstream),
    ]
    failures = _check(sent.expected, balances, payments.outcomes, downstream.outcomes, notified)
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


def _report_payments(sent: Sent, stage: _Stage, dead_letters: list[Message]) -> list[str]:
    done = stage.outcomes
    return [
        "",
        f"The producer sent {PAYMENTS + sent.retried + len(BAD):,} messages to {QUEUE!r}:",
        f"  {PAYMENTS:>6,}  payments, each crediting one of {len(ACCOUNTS)} accounts",
        f"  {sent.retried:>6,}  of them sent a second time (the producer retried after a timeout)",
        f"  {len(BAD):>6,}  bad messages: malformed JSON, an unknown account, a reused id",
        "",
        f"The broker made {stage.deliveries:,} deliveries:",
        f"  {stage.deliveries - stage.again:>6,}  first deliveries, one per message",
        f"  {stage.again:>6,}  deliveries again, as after a lost ack or a rebalance, and after",
        f"          {stage.restarts} crashes of the consumer between commit and ack "
        "(restarted each time)",
        "",
        f"consumerdedup decided each of the {stage.deliveries:,} deliveries:",
        f"  {done[Outcome.PROCESSED]:>6,}  processed: the credit committed, once per payment",
        f"  {done[Outcome.DUPLICATE]:>6,}  duplicates: already processed, the handler did not run",
        f"  {done[Outcome.FAILED]:>6,}  failed: recorded, and dead-lettered with the reason:",
        *(f"            {m.id}: {_short(m.headers.get(REASON_HEADER))}" for m in dead_letters),
    ]


def _report_without(naive: WithoutDedup, sent: Sent, stage: _Stage) -> list[str]:
    credits = naive.credits
    wrong = sum(naive.balances[a] != sent.expected[a] for a in ACCOUNTS)
    return [
        "",
        f"Without deduplication, the same handler on the same {stage.deliveries:,} deliveries "
        "would have",
        f"applied {credits.total():,} credits for {PAYMENTS:,} payments:",
        f"  {credits[Outcome.PROCESSED]:>6,}  credits, one per payment",
        f"  {credits[Outcome.DUPLICATE]:>6,}  credits applied again, one per duplicate delivery",
        f"  {credits[Outcome.FAILED]:>6,}  credit of {REUSED_AMOUNT:,} to ACC-001 "
        "under the reused id",
        f"It would have credited {naive.balances.total():,} in all instead of "
        f"{sum(sent.expected.values()):,}: {wrong} of {len(ACCOUNTS)} balances wrong.",
    ]


def _report_events(events: int, relayed: int, stage: _Stage) -> list[str]:
    done = stage.outcomes
    return [
        "",
        f"Each credit wrote an event to the outbox in its own transaction: {events:,} events.",
        f"The relay sent {relayed:,}: it was killed once after the broker confirmed "
        f"{RELAY_DIES_AFTER} events,",
        f"before marking them sent, so those {relayed - events} went twice: the relay publishes "
        "at least once.",
        f"The downstream consumer got {stage.deliveries:,} deliveries "
        f"({stage.deliveries - stage.again:,} first, {stage.again:,} again) and decided:",
        f"  {done[Outcome.PROCESSED]:>6,}  notifications sent",
        f"  {done[Outcome.DUPLICATE]:>6,}  duplicates: already notified, the handler did not run",
        "",
    ]


def _short(reason: str | None, width: int = 64) -> str:
    reason = reason or ""
    return reason if len(reason) <= width else reason[: width - 3] + "..."


def _check(
    expected: dict[str, int],
    balances: dict[str, int],
    outcomes: Counter[Outcome],
    downstream: Counter[Outcome],
    notified: int,
) -> list[str]:
    failures = []
    wrong = {a: (balances[a], expected[a]) for a in ACCOUNTS if balances[a] != expected[a]}
    if wrong:
        failures.append(f"{len(wrong)} balances are wrong (actual, expected): {wrong}")
    if outcomes[Outcome.PROCESSED] != PAYMENTS:
        failures.append(f"{outcomes[Outcome.PROCESSED]} payments processed, not {PAYMENTS}")
    if notified != PAYMENTS or downstream[Outcome.PROCESSED] != PAYMENTS:
        failures.append(f"{notified} notifications for {PAYMENTS} credits")
    return failures


def _stage(broker: MemoryBroker, queue: str, handler: DedupHandler) -> _Stage:
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
    return _Stage(
        deliveries=broker.delivered - delivered,
        again=broker.redelivered - again,
        outcomes=outcomes,
        restarts=restarts,
    )
