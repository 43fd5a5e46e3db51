"""The framework-free parts alone: key parsing, policy validation, stored responses, flow.

Fast checks of the edges the server suite cannot reach cheaply (every
refused character, every refused setting); the behaviour itself is proven
end to end in test_idempotency.py.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from consumerdedup import ConfigurationError
from consumerdedup.http import (
    IdempotencyPolicy,
    InvalidIdempotencyKey,
    RequestFacts,
    RoutePolicy,
    StoredResponse,
    default_fingerprint,
    flow,
    idempotent,
    json_fields,
    parse_key,
)
from consumerdedup.http.policy import RoutePattern, route_mark
from consumerdedup.http.store import Claimed, Completed, InFlight, Mismatch
from consumerdedup.http.stored import CorruptStoredResponse


@pytest.mark.parametrize(
    ("raw", "key"),
    [(b"abc", "abc"), (b'"abc"', "abc"), (b'  "a\\"b\\\\c"\t', 'a"b\\c'), (b'"a b"', "a b"),
     (b"x" * 255, "x" * 255), (b'"' + b"y" * 255 + b'"', "y" * 255),
     (b"~!#$%&'*+-.^_`|", "~!#$%&'*+-.^_`|")],
)  # fmt: skip
def test_keys_accepted(raw: bytes, key: str) -> None:
    assert parse_key([raw]) == key


@pytest.mark.parametrize("code", [*range(0, 32), 127, 128, 255])
def test_every_non_printable_character_is_refused_bare_and_quoted(code: int) -> None:
    char = bytes([code])
    inside = b"a" + char + b"b"  # OWS (tab, space) is stripped at the ends: put it inside
    with pytest.raises(InvalidIdempotencyKey):
        parse_key([inside])
    if code != 32:  # a space is printable: fine inside quotes
        with pytest.raises(InvalidIdempotencyKey):
            parse_key([b'"' + inside + b'"'])


@pytest.mark.parametrize(
    "raw", [b"", b'""', b"x" * 256, b'"' + b"z" * 256 + b'"', b'"\\a"', b'"abc', b'"a"b', b"a,b",
            b'a"b', b"a\\b", "é".encode(), b'"' + b"\\\\" * 300 + b'"'],
)  # fmt: skip
def test_keys_refused(raw: bytes) -> None:
    with pytest.raises(InvalidIdempotencyKey) as refused:
        parse_key([raw])
    assert "send" in str(refused.value)  # every reason tells the client what to do


def test_no_header_is_no_key_and_two_are_refused() -> None:
    assert parse_key([]) is None
    with pytest.raises(InvalidIdempotencyKey):
        parse_key([b"a", b"a"])


@pytest.mark.parametrize(
    "settings",
    [{"methods": frozenset({"GET"})}, {"methods": frozenset({"POST", "PUT"})},
     {"methods": frozenset()}, {"expiry": timedelta(0)}, {"lease": timedelta(0)},
     {"wait": timedelta(seconds=-1)}, {"max_stored_body": -1}, {"max_request_body": True},
     {"required": "yes"}, {"fingerprint": "sha256"}, {"expiry": 3600}],
)  # fmt: skip
def test_a_bad_route_policy_is_refused(settings: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        RoutePolicy(**settings)  # type: ignore[arg-type]


def test_patterns_and_first_match_wins() -> None:
    policy = IdempotencyPolicy.of(
        {
            "/orders/{id}/pay": RoutePolicy(required=True),
            "/orders/*": RoutePolicy(wait=timedelta(1)),
        }
    )
    assert policy.for_request("POST", "/orders/7/pay") == RoutePolicy(required=True)
    assert policy.for_request("POST", "/orders/7/x/pay") == RoutePolicy(wait=timedelta(1))
    assert policy.for_request("POST", "/other") == RoutePolicy()
    assert policy.for_request("PATCH", "/other") is None
    assert policy.for_request("GET", "/orders/7/pay") is None
    assert RoutePattern("/a/{id:int}").matches("/a/12") and not RoutePattern("/a").matches("/ab")
    for bad in ("payments", "/a/{id", "/a/}"):
        with pytest.raises(ConfigurationError):
            RoutePattern(bad)


def test_a_marked_endpoint_joins_the_policy() -> None:
    @idempotent(required=True)
    def endpoint() -> None: ...

    class Route:
        path = "/pay/{id}"

    route = Route()
    route.endpoint = endpoint  # type: ignore[attr-defined]
    assert route_mark(route) == RoutePolicy(required=True)
    policy = IdempotencyPolicy().with_routes([route])
    assert policy.for_request("POST", "/pay/1") == RoutePolicy(required=True)


def test_fingerprints_tell_parts_apart() -> None:
    base = RequestFacts("POST", "/p", b"a=1", b"body")
    moved = RequestFacts("POST", "/p", b"a=1b", b"ody")  # bytes moved between parts
    assert default_fingerprint(base) != default_fingerprint(moved)
    by_fields = json_fields("amount")
    one = by_fields(RequestFacts("POST", "/p", b"", b'{"amount": 5, "note": "x"}'))
    two = by_fields(RequestFacts("POST", "/p", b"", b'{"note":"y","amount":5}'))
    assert one == two != by_fields(RequestFacts("POST", "/p", b"", b'{"amount": 6}'))


def test_stored_responses_drop_what_must_not_be_replayed_and_round_trip() -> None:
    response = StoredResponse.capture(
        201,
        [(b"Content-Type", b"application/json"), (b"Set-Cookie", b"s=1"), (b"Date", b"x"),
         (b"Connection", b"close, X-Secret"), (b"X-Secret", b"y"),
         (b"Transfer-Encoding", b"chunked"), (b"X-Kept", b"z")],
        b"\x00\xffbody",
    )  # fmt: skip
    assert response.headers == (("content-type", "application/json"), ("x-kept", "z"))
    assert StoredResponse.from_bytes(response.to_bytes()) == response
    tombstone = StoredResponse.unreplayable(200)
    assert StoredResponse.from_bytes(tombstone.to_bytes()) == tombstone
    for blob in (b"no newline", b"{}\nbody", b'{"v": 99}\n'):
        with pytest.raises(CorruptStoredResponse):
            StoredResponse.from_bytes(blob)


def _drive(steps: object, replies: list[object]) -> tuple[list[object], flow.Decision]:
    """Run flow.decide with canned replies; the operations it asked for and its decision."""
    asked: list[object] = []
    reply: object = None
    try:
        while True:
            asked.append(steps.send(reply))  # type: ignore[attr-defined]
            reply = replies.pop(0)
    except StopIteration as stop:
        return asked, stop.value


def _incoming(key: str = "k") -> flow.Incoming:
    return flow.Incoming("POST", "/p", b"", (("idempotency-key", key),), "alice")


def test_flow_stores_a_4xx_and_releases_a_5xx_and_retry_later_answers() -> None:
    policy = IdempotencyPolicy()
    for status, stored in [(201, True), (404, True), (500, False), (503, False), (429, False)]:
        response = StoredResponse(status, (), b"")
        asked, decision = _drive(
            flow.decide(_incoming(), policy), [b"", Claimed("t"), flow.Finished(response), True]
        )
        kinds = [type(op).__name__ for op in asked]
        assert kinds[-1] == ("Complete" if stored else "Release"), (status, kinds)
        assert decision == flow.SendCaptured(stored=stored)


def test_flow_answers_every_claim_result() -> None:
    policy = IdempotencyPolicy()
    stored = StoredResponse(201, (), b"x")
    for result, name in [(Mismatch(), "key-reused"), (InFlight(2.5), "in-flight")]:
        _, decision = _drive(flow.decide(_incoming(), policy), [b"", result])
        assert isinstance(decision, flow.Respond)
        assert name.encode() in decision.response.body
    _, decision = _drive(flow.decide(_incoming(), policy), [b"", Completed(stored)])
    assert decision == flow.Respond(stored, replayed=True)
    in_flight = flow.Respond
    # Retry-After is the route's retry_after (1 s), not the rest of the twin's lease...
    _, decision = _drive(flow.decide(_incoming(), policy), [b"", InFlight(59.5)])
    assert isinstance(decision, in_flight) and ("retry-after", "1") in decision.response.headers
    # ...nor more than that rest; at least 1 s (whole seconds).
    slow = IdempotencyPolicy(RoutePolicy(retry_after=timedelta(seconds=5)))
    for lease_left, told in [(2.5, "3"), (0.2, "1"), (30.0, "5")]:
        _, decision = _drive(flow.decide(_incoming(), slow), [b"", InFlight(lease_left)])
        assert isinstance(decision, in_flight)
        assert ("retry-after", told) in decision.response.headers, lease_left


def test_flow_releases_the_routes_unstored_statuses_and_stores_the_rest() -> None:
    policy = IdempotencyPolicy(RoutePolicy(unstored_statuses=frozenset({422})))
    for status, stored in [(422, False), (400, True), (201, True), (500, False)]:
        response = StoredResponse(status, (), b"")
        asked, decision = _drive(
            flow.decide(_incoming(), policy), [b"", Claimed("t"), flow.Finished(response), True]
        )
        assert type(asked[-1]).__name__ == ("Complete" if stored else "Release"), status
        assert decision == flow.SendCaptured(stored=stored)


def test_a_run_past_its_lease_is_logged_as_a_warning_and_still_completes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    response = StoredResponse(201, (), b"")
    with caplog.at_level("WARNING", logger="consumerdedup.http"):
        asked, decision = _drive(
            flow.decide(_incoming(), IdempotencyPolicy()),
            [b"", Claimed("t"), flow.Finished(response, lapsed=True), True],
        )
    assert type(asked[-1]).__name__ == "Complete" and decision == flow.SendCaptured(stored=True)
    [line] = [r for r in caplog.records if "lease expired" in r.getMessage()]
    assert line.levelname == "WARNING" and "60 s lease" in line.getMessage()


def test_the_principal_is_in_the_scope_only_as_a_digest() -> None:
    scope = flow.scope_of("POST", "/p", "api-key-123")
    assert "api-key-123" not in scope and scope != flow.scope_of("POST", "/p", "other")
    assert flow.scope_of("POST", "/p", None) == "POST /p"
    assert len(flow.scope_of("POST", "/" + "p" * 1000, "x")) <= flow.SCOPE_LENGTH


def test_a_fingerprinter_that_returns_no_str_is_a_setup_fault_not_a_store_outage() -> None:
    policy = IdempotencyPolicy(RoutePolicy(fingerprint=lambda facts: facts.body))
    with pytest.raises(ConfigurationError, match=r"RoutePolicy\.fingerprint returned a bytes"):
        _drive(flow.decide(_incoming(), policy), [b"x"])
