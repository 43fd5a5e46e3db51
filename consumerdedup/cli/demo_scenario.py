"""The demo's scenario: what the producer sends and the faults injected around it.

``demo`` runs it and writes the report; this module holds the stream (payments,
producer retries, three bad messages), the relay that dies once, and the
observer that counts what a consumer without deduplication would have credited.
"""

from __future__ import annotations

import json
import random
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from ..errors import SimulatedCrash
from ..outbox.publisher import Publisher
from ..outcome import Outcome, Result
from ..testing import MemoryBroker
from ..testing.memory_broker import Delivery

QUEUE = "payments"
EVENTS = "account-events"
ACCOUNTS = [f"ACC-{n:03d}" for n in range(1, 21)]
PAYMENTS = 1_000
CRASHES = 8
RELAY_DIES_AFTER = 5
BAD = ("pay-malformed", "pay-unknown", "pay-00000")
REUSED_AMOUNT = 1_000_000


@dataclass
class Sent:
    """What the producer sent: the payments it meant, and the copies it retried."""

    expected: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    retried: int = 0


class WithoutDedup:
    """An observer: what a consumer without deduplication would have credited.

    It sees every delivery the pipeline decided (duplicates included) and
    credits each one whose body it can read and whose account exists, as the
    same handler run on every delivery would; ``credits`` counts them by what
    consumerdedup decided for that delivery.
    """

    def __init__(self) -> None:
        self.credits: Counter[Outcome] = Counter()
        self.balances: Counter[str] = Counter()

    def __call__(self, result: Result) -> None:
        try:
            payment = json.loads(result.message.body)
        except ValueError:
            return
        if payment.get("account") in ACCOUNTS:
            self.credits[result.outcome] += 1
            self.balances[payment["account"]] += payment["amount"]


class DiesOnce(Publisher):
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


def is_offset(offset: int, delivery: Delivery) -> bool:
    return delivery.offset == offset


def publish(broker: MemoryBroker, rng: random.Random) -> Sent:
    """Publish the payments, with producer retries, a poison message and a reused id."""
    sent = Sent()
    for n in range(PAYMENTS):
        account, amount = rng.choice(ACCOUNTS), rng.randint(1, 500)
        body = json.dumps({"account": account, "amount": amount}).encode()
        copies = 2 if rng.random() < 0.05 else 1  # the producer retried after a timeout
        sent.retried += copies - 1
        for _ in range(copies):
            broker.publish(QUEUE, body, message_id=f"pay-{n:05d}")
        sent.expected[account] += amount
    broker.publish(QUEUE, b"{not json", message_id=BAD[0])
    broker.publish(QUEUE, b'{"account": "ACC-999", "amount": 5}', message_id=BAD[1])
    # A buggy producer reuses an id for a different payment: reported, never applied.
    reused = json.dumps({"account": "ACC-001", "amount": REUSED_AMOUNT}).encode()
    broker.publish(QUEUE, reused, message_id=BAD[2])
    return sent
