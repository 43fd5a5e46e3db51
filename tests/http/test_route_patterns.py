"""Issue 38 item 4: a route pattern that can never match a request path is refused at
construction, with the reason (before: ``"/pay "`` and ``"/pay?x=1"`` were accepted and
never matched, so a route the user asked to protect, even ``required=True``, was not).

Every pattern refused here is also shown, before the fix, to match nothing a client can
send: the request paths tried are what an ASGI server puts in ``scope["path"]``.
"""

from __future__ import annotations

import pytest

from consumerdedup import ConfigurationError
from consumerdedup.http import IdempotencyPolicy, RoutePolicy
from consumerdedup.http.policy import RoutePattern

NEVER_MATCH = {
    "/pay ": "whitespace",
    " /pay": "start with /",
    "/pay\t": "whitespace",
    "/p ay": "whitespace",
    "/pay\n": "whitespace",
    "/pay?x=1": "query string",
    "/pay?": "query string",
    "/pay#top": "fragment",
    "pay": "start with /",
    "": "start with /",
    "/pay\x00": "control character",
    "/pay\x7f": "control character",
    "/pay\u200b": "control character",  # a zero-width space (format character)
    "/pay%20now": "percent-decoded",
    "/a/*/b": "trailing *",
    "/a*b": "trailing *",
    "/a/{id": "brace",
    "/a/}": "brace",
    "http://host/pay": "start with /",
}


@pytest.mark.parametrize(("pattern", "reason"), NEVER_MATCH.items(), ids=repr)
def test_a_pattern_that_can_never_match_is_refused_with_its_reason(
    pattern: str, reason: str
) -> None:
    with pytest.raises(ConfigurationError) as refused:
        IdempotencyPolicy.of({pattern: RoutePolicy(required=True)})
    assert repr(pattern) in str(refused.value)
    assert reason in str(refused.value)


@pytest.mark.parametrize("pattern", [5, None, b"/pay", ["/pay"]], ids=repr)
def test_a_pattern_that_is_not_a_str_is_refused(pattern: object) -> None:
    with pytest.raises(ConfigurationError, match="route pattern"):
        RoutePattern(pattern)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("pattern", "path"),
    [("/pay", "/pay"), ("/pay/", "/pay/"), ("/orders/{id}/pay", "/orders/7/pay"),
     ("/a/{id:int}", "/a/12"), ("/admin/*", "/admin/x/y"), ("/*", "/anything"),
     ("/files/{rest:path}", "/files/a/b/c"), ("/zahlung/über", "/zahlung/über"),
     ("/a%b", "/a%b"), ("/a+b;c=d,e", "/a+b;c=d,e")],
)  # fmt: skip
def test_patterns_that_can_match_are_accepted_and_match(pattern: str, path: str) -> None:
    assert RoutePattern(pattern).matches(path)


def test_a_path_converter_spans_segments_and_others_do_not() -> None:
    """Starlette's ``{name:path}`` matches several segments; before, it matched one only, so
    ``/files/a/b`` was silently not protected."""
    assert RoutePattern("/files/{rest:path}").matches("/files/a/b")
    assert not RoutePattern("/files/{name}").matches("/files/a/b")
