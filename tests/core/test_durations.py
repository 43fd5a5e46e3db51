"""durations.parse: a table of what is accepted and what is refused, with the reason."""

from __future__ import annotations

from datetime import timedelta

import pytest

from consumerdedup import ConfigurationError
from consumerdedup.durations import parse, render

ACCEPTED = [
    ("500ms", timedelta(milliseconds=500)),
    ("90s", timedelta(seconds=90)),
    ("15m", timedelta(minutes=15)),
    ("36h", timedelta(hours=36)),
    ("7d", timedelta(days=7)),
    ("2w", timedelta(weeks=2)),
    ("1d12h", timedelta(days=1, hours=12)),
    ("1m30s", timedelta(minutes=1, seconds=30)),
    ("1s250ms", timedelta(seconds=1, milliseconds=250)),
    (" 7d ", timedelta(days=7)),
    ("1d 12h", timedelta(days=1, hours=12)),
]

REFUSED = [
    ("7M", "units are lowercase (ms, s, m (minutes), h, d, w)"),
    ("15M", "could mean minutes or months"),
    ("7D", "units are lowercase"),
    ("36H", "units are lowercase"),
    ("90S", "units are lowercase"),
    ("2W", "units are lowercase"),
    ("500MS", "units are lowercase"),
    ("1d12H", "units are lowercase"),
    ("7", "is not a duration"),
    ("7mo", "is not a duration"),
    ("7min", "is not a duration"),
    ("7y", "is not a duration"),
    ("7days", "is not a duration"),
    ("1.5h", "is not a duration"),
    ("7x", "is not a duration"),
    ("", "is not a duration"),
    ("0d", "is zero"),
    ("0ms", "is zero"),
    ("-1d", "is negative"),
    ("forever", "must be a finite duration"),
    ("Forever", "must be a finite duration"),
    ("99999999999d", "is too long"),
]


@pytest.mark.parametrize(("text", "expected"), ACCEPTED)
def test_documented_units_are_accepted(text: str, expected: timedelta) -> None:
    assert parse(text) == expected


@pytest.mark.parametrize(("text", "fragment"), REFUSED)
def test_anything_else_is_refused_with_the_reason(text: str, fragment: str) -> None:
    with pytest.raises(ConfigurationError, match=r"^--retention ") as raised:
        parse(text, "--retention")
    assert fragment in str(raised.value)


@pytest.mark.parametrize(("text", "expected"), ACCEPTED)
def test_render_gives_back_what_parse_takes(text: str, expected: timedelta) -> None:
    assert parse(render(expected)) == expected
