"""A twin on a route that waits: how often it looks again, counted without a clock.

The integration suite (test_idempotency) proves that every twin is replayed; how promptly
was once a wall-clock bound there (20 twins over HTTP in under 4 s), which a loaded CI
machine could break. The promptness is the pause schedule of ``flow._claim``: read here.
"""

from __future__ import annotations

from datetime import timedelta

from consumerdedup.http import flow
from consumerdedup.http.operations import Claim, Pause, Respond
from consumerdedup.http.policy import RoutePolicy
from consumerdedup.http.store import Claimed, Completed, InFlight
from consumerdedup.http.stored import StoredResponse

WAIT = timedelta(seconds=5)
RESPONSE = StoredResponse(201, (("content-type", "application/json"),), b'{"id": 1}')


def _pauses_until(answers: list[object], wait: timedelta = WAIT) -> tuple[list[float], object]:
    """Drive one twin's claim: each Claim is answered with the next of ``answers``."""
    claim = Claim("POST /wait", "k", "f", RoutePolicy(required=True, wait=wait))
    steps = flow._claim(claim, "POST /wait", "k", waits_in_store=False)
    pauses: list[float] = []
    operation = next(steps)
    replies = iter(answers)
    try:
        while True:
            if isinstance(operation, Pause):
                pauses.append(operation.seconds)
                operation = steps.send(None)
            else:
                assert isinstance(operation, Claim)
                operation = steps.send(next(replies))
    except StopIteration as done:
        return pauses, done.value


def test_a_twin_looks_again_at_least_every_half_second_while_it_waits() -> None:
    """Doubling from 20 ms, capped at 0.5 s: a twin is replayed at most 0.5 s after its
    first request completes, however long that ran (within the route's wait)."""
    pauses, decision = _pauses_until([InFlight(60.0)] * 8 + [Completed(RESPONSE)])
    assert pauses == [0.02, 0.04, 0.08, 0.16, 0.32, 0.5, 0.5, 0.5]
    assert isinstance(decision, Respond) and decision.replayed
    assert decision.response == RESPONSE


def test_a_twin_pauses_no_longer_than_the_rest_of_the_route_s_wait() -> None:
    pauses, decision = _pauses_until([InFlight(60.0)] * 100)
    assert max(pauses) <= 0.5
    assert abs(sum(pauses) - WAIT.total_seconds()) < 1e-9  # then 409, not a longer wait
    assert isinstance(decision, Respond) and not decision.replayed
    assert decision.response.status == 409


def test_a_twin_that_gets_the_key_runs_without_a_pause() -> None:
    pauses, decision = _pauses_until([Claimed("token")])
    assert pauses == [] and decision == Claimed("token")
