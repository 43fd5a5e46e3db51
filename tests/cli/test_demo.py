"""``consumerdedup demo``: its report's counts add up on their face, and say what dedup saved.

The demo is a newcomer's first sight of the library: every group of counts in
its report must sum to the total it stands under, and the comparison with a
consumer without deduplication must follow from those counts.
"""

from __future__ import annotations

import io
import re

import pytest

from consumerdedup.cli import demo
from consumerdedup.cli.demo_scenario import BAD, CRASHES, PAYMENTS, RELAY_DIES_AFTER


def number(pattern: str, text: str) -> int:
    found = re.search(pattern, text)
    assert found, f"{pattern!r} not in the report:\n{text}"
    return int(found.group(1).replace(",", ""))


@pytest.fixture(scope="module")
def report() -> str:
    out = io.StringIO()
    assert demo.play(out) == 0, out.getvalue()
    return out.getvalue()


N = r"([\d,]+)"


def test_what_was_sent_adds_up(report: str) -> None:
    sent = number(rf"The producer sent {N} messages", report)
    payments = number(rf"\n +{N}  payments, each", report)
    retried = number(rf"\n +{N}  of them sent a second time", report)
    bad = number(rf"\n +{N}  bad messages", report)
    assert payments == PAYMENTS and retried > 0 and bad == 3
    assert sent == payments + retried + bad


def test_deliveries_add_up_and_each_has_one_outcome(report: str) -> None:
    sent = number(rf"The producer sent {N} messages", report)
    deliveries = number(rf"The broker made {N} deliveries", report)
    first = number(rf"\n +{N}  first deliveries", report)
    again = number(rf"\n +{N}  deliveries again", report)
    assert first == sent and again > 0
    assert deliveries == first + again
    assert number(rf"decided each of the {N} deliveries", report) == deliveries
    processed = number(rf"\n +{N}  processed: the credit", report)
    duplicates = number(rf"\n +{N}  duplicates: already processed", report)
    failed = number(rf"\n +{N}  failed: recorded", report)
    assert processed == PAYMENTS and duplicates > 0 and failed == 3
    assert deliveries == processed + duplicates + failed
    assert number(rf"after\s+{N} crashes", report) == CRASHES
    for message_id in BAD:
        assert f"{message_id}: " in report


def test_without_dedup_the_extra_credits_are_the_duplicates(report: str) -> None:
    deliveries = number(rf"The broker made {N} deliveries", report)
    duplicates = number(rf"\n +{N}  duplicates: already processed", report)
    naive = number(rf"applied {N} credits for", report)
    once = number(rf"\n +{N}  credits, one per payment", report)
    again = number(rf"\n +{N}  credits applied again", report)
    reused = number(rf"\n +{N}  credit of 1,000,000", report)
    assert number(rf"the same {N} deliveries", report) == deliveries
    assert naive == once + again + reused
    assert once == PAYMENTS and again == duplicates and reused == 1
    # Only the malformed body and the unknown account give it nothing to credit.
    assert naive == deliveries - 2
    exact = number(rf"instead of {N}", report)
    assert number(rf"credited {N} in all", report) > exact + 1_000_000
    assert number(rf"balances are exact \(total {N}\)", report) == exact


def test_events_add_up(report: str) -> None:
    events = number(rf"in its own transaction: {N} events", report)
    relayed = number(rf"The relay sent {N}", report)
    twice = number(rf"so those {N} went twice", report)
    # By construction, not by chance: the first relay dies right after the broker confirmed
    # its RELAY_DIES_AFTER-th event, before marking any of them; the next one sends them again.
    assert events == PAYMENTS and relayed == events + twice and twice == RELAY_DIES_AFTER
    deliveries = number(rf"downstream consumer got {N} deliveries", report)
    first = number(rf"\({N} first", report)
    again = number(rf"first, {N} again\)", report)
    assert first == relayed and deliveries == first + again
    sent = number(rf"\n +{N}  notifications sent", report)
    duplicates = number(rf"\n +{N}  duplicates: already notified", report)
    assert sent == PAYMENTS and deliveries == sent + duplicates
    assert number(rf"OK: {N} notifications for", report) == sent
