"""The embedded demo: a payments consumer on SQLite and the in-memory broker, under fire.

Payments credit accounts. The broker redelivers acked messages at random (as
after a lost ack or a rebalance), the producer retries some publishes, the
consumer is killed between commit and ack several times and restarted, and
the stream carries a malformed message and a reused id. At the end every
balance must be exactly the sum of the distinct payments.
"""

from __future__ import annotations

import json
import logging
import random
import tempfile
from collections import Counter, defaultdict
from functools import partial
from pathlib import Path
from typing import TextIO

from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from .deduplicator import Deduplicator
from .errors import PermanentError, SimulatedCrash
from .message import Message
from .outcome import Outcome
from .schema import install
from .testing import MemoryBroker, MemoryConsumerRunner
from .testing.memory_broker import Delivery

QUEUE = "payments"
ACCOUNTS = [f"ACC-{n:03d}" for n in range(1, 21)]
PAYMENTS = 1_000
CRASHES = 8


def run(out: TextIO) -> int:
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

    rng = random.Random(2026)
    broker = MemoryBroker(duplicate_rate=0.15, seed=7)
    expected = _publish(broker, rng)
    crash_points = set(rng.sample(range(PAYMENTS), CRASHES))
    for n in sorted(crash_points):
        broker.crash_before_ack(partial(_is_offset, n))

    dedup = Deduplicator(engine, consumer="ledger")

    @dedup.handler
    def credit(message: Message, session: Session) -> None:
        payment = message.json()
        if payment.get("account") not in ACCOUNTS:
            raise PermanentError(f"unknown account {payment.get('account')!r}")
        session.execute(
            text("UPDATE accounts SET balance = balance + :amount WHERE id = :account"),
            payment,
        )

    restarts = 0
    outcomes: Counter[Outcome] = Counter()
    while True:
        runner = MemoryConsumerRunner(broker, QUEUE, credit, batch_size=10)
        try:
            runner.run(until_idle=True)
        except SimulatedCrash:
            restarts += 1  # the process died after COMMIT, before ACK; a supervisor restarts it
            continue
        finally:
            outcomes.update(runner.outcomes)
        break

    with engine.connect() as conn:
        rows = conn.execute(text("SELECT id, balance FROM accounts")).tuples()
        balances: dict[str, int] = dict(rows.all())
        records = conn.execute(text("SELECT count(*) FROM processed_events")).scalar()
    engine.dispose()
    dead = broker.messages(QUEUE + ".dlq")
    return _report(out, broker, outcomes, restarts, expected, balances, records, dead)


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


def _report(
    out: TextIO,
    broker: MemoryBroker,
    outcomes: Counter[Outcome],
    restarts: int,
    expected: dict[str, int],
    balances: dict[str, int],
    records: object,
    dead: list[Message],
) -> int:
    wrong = {a: (balances[a], expected[a]) for a in ACCOUNTS if balances[a] != expected[a]}
    lines = [
        "consumerdedup demo: payments consumer on SQLite + in-memory broker",
        "",
        f"  payments published            {PAYMENTS:>6}",
        f"    + producer retries, bad     {broker.published - PAYMENTS:>6}",
        f"  deliveries                    {broker.delivered:>6}",
        f"    redelivered                 {broker.redelivered:>6}",
        f"  crashes between commit & ack  {restarts:>6}  (consumer restarted each time)",
        f"  processed (handler ran)       {outcomes[Outcome.PROCESSED]:>6}",
        f"  duplicates skipped            {outcomes[Outcome.DUPLICATE]:>6}",
        f"  failed -> dead-letter queue   {outcomes[Outcome.FAILED]:>6}",
        f"  dedup records                 {records!s:>6}",
        "",
        "  dead letters:",
        *(f"    {m.id}: {m.headers.get('x-dead-letter-reason')}" for m in dead),
        "",
    ]
    if wrong:
        lines.append(f"  FAIL: {len(wrong)} balances are wrong: {wrong}")
    else:
        total = sum(balances.values())
        lines.append(
            f"  OK: all {len(ACCOUNTS)} account balances are exact (total {total}): "
            "every payment applied exactly once"
        )
    out.write("\n".join(lines) + "\n")
    return 1 if wrong or outcomes[Outcome.PROCESSED] != PAYMENTS else 0
