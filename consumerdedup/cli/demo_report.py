"""The demo's report: what was sent, what the broker delivered, what the consumer
decided, and what a consumer without deduplication would have credited.

Every group of counts adds up to the total it stands under (tests/cli/test_demo.py
reads them back); ``check`` says what would make the demo fail.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..headers import REASON_HEADER
from ..message import Message
from ..outcome import Outcome
from .demo_scenario import (
    ACCOUNTS,
    BAD,
    PAYMENTS,
    QUEUE,
    RELAY_DIES_AFTER,
    REUSED_AMOUNT,
    Sent,
    WithoutDedup,
)


@dataclass
class Stage:
    """The broker's counters over one consumer's run, and what the consumer decided."""

    deliveries: int
    again: int
    outcomes: Counter[Outcome]
    restarts: int


def payments_lines(sent: Sent, stage: Stage, dead_letters: list[Message]) -> list[str]:
    """What the producer sent, what the broker delivered, what the consumer decided."""
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


def without_dedup_lines(naive: WithoutDedup, sent: Sent, stage: Stage) -> list[str]:
    """What the same handler would have credited on every delivery, duplicates included."""
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


def events_lines(events: int, relayed: int, stage: Stage) -> list[str]:
    """The outbox's events, what the relay sent, and what the downstream consumer decided."""
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


def check(
    expected: dict[str, int],
    balances: dict[str, int],
    outcomes: Counter[Outcome],
    downstream: Counter[Outcome],
    notified: int,
) -> list[str]:
    """Why the demo failed, if it did: a wrong balance, a payment or a notification missing."""
    failures = []
    wrong = {a: (balances[a], expected[a]) for a in ACCOUNTS if balances[a] != expected[a]}
    if wrong:
        failures.append(f"{len(wrong)} balances are wrong (actual, expected): {wrong}")
    if outcomes[Outcome.PROCESSED] != PAYMENTS:
        failures.append(f"{outcomes[Outcome.PROCESSED]} payments processed, not {PAYMENTS}")
    if notified != PAYMENTS or downstream[Outcome.PROCESSED] != PAYMENTS:
        failures.append(f"{notified} notifications for {PAYMENTS} credits")
    return failures
