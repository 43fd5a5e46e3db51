"""Backoff: the one exponential wait that every retrying loop uses.

The pipeline's in-process retries, the relay's rows and rounds, the pruner's failed
rounds, the RabbitMQ runner's reconnects and redeliveries and the RabbitMQ publisher's
connection attempts all take their waits from it, so these few rules hold everywhere.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import tenacity

from consumerdedup import ConfigurationError
from consumerdedup.retry import Backoff, RetryPolicy

MS = timedelta(milliseconds=1)


def test_doubles_per_failure_and_stops_at_longest() -> None:
    backoff = Backoff(100 * MS, 1000 * MS, jitter=False)
    assert [backoff.delay(n) for n in range(1, 7)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])


def test_a_long_run_of_failures_stays_at_longest() -> None:
    assert Backoff(MS, timedelta(seconds=30), jitter=False).delay(10_000) == pytest.approx(30.0)


def test_jitter_adds_at_most_first() -> None:
    backoff = Backoff(100 * MS, 1000 * MS)
    for failures in (1, 3, 10):
        plain = Backoff(100 * MS, 1000 * MS, jitter=False).delay(failures)
        waits = [backoff.delay(failures) for _ in range(200)]
        assert all(plain <= wait <= plain + 0.1 for wait in waits)
        assert len(set(waits)) > 1


def test_it_is_a_tenacity_wait() -> None:
    backoff = Backoff(10 * MS, 40 * MS, jitter=False)
    waits: list[float] = []
    retrying = tenacity.Retrying(
        wait=backoff,
        stop=tenacity.stop_after_attempt(5),
        sleep=waits.append,
        retry=tenacity.retry_if_result(lambda value: True),
        retry_error_callback=lambda state: None,
    )
    retrying(lambda: "again")
    assert waits == pytest.approx([0.01, 0.02, 0.04, 0.04])


def test_the_retry_policy_backs_off_with_it() -> None:
    policy = RetryPolicy(initial_delay=50 * MS, max_delay=2 * timedelta(seconds=1))
    assert policy.backoff() == Backoff(50 * MS, timedelta(seconds=2))


@pytest.mark.parametrize(("first", "longest"), [(-MS, MS), (2 * MS, MS)])
def test_impossible_bounds_are_refused(first: timedelta, longest: timedelta) -> None:
    with pytest.raises(ConfigurationError):
        Backoff(first, longest)
