"""failed.selection.Selection: which dead letters a replay takes, checked where it is made."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from consumerdedup.errors import ConfigurationError
from consumerdedup.failed.report import DeadLetter
from consumerdedup.failed.selection import Selection

NOW = datetime.now(UTC)
LETTER = DeadLetter("shop", "order-1", "orders", "KeyError: 'sku'")


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("consumer", ["shop"]),
        ("reason", ""),
        ("error_type", "Key Error"),
        ("error_type", " "),
        ("since", NOW.replace(tzinfo=None)),
        ("until", "2026-01-01"),
        ("only_recorded", "no"),
    ],
)
def test_a_wrong_option_is_refused_naming_it(option: str, value: object) -> None:
    with pytest.raises(ConfigurationError, match=f"Selection.{option}"):
        Selection(**{option: value})  # type: ignore[arg-type]


def test_what_a_selection_takes() -> None:
    failed_at = NOW - timedelta(hours=2)
    assert Selection().matches(LETTER, None)
    assert Selection(error_type="KeyError").matches(LETTER, None)
    assert not Selection(error_type="Key").matches(LETTER, None)
    assert Selection(reason="'SKU'").matches(LETTER, None)
    assert not Selection(consumer="mail").matches(LETTER, failed_at)
    assert Selection(since=NOW - timedelta(days=1)).matches(LETTER, failed_at)
    assert not Selection(since=NOW - timedelta(days=1)).matches(LETTER, None)  # no time known
    assert not Selection(until=failed_at).matches(LETTER, failed_at)  # until is exclusive
    assert Selection(since=failed_at).matches(LETTER, failed_at)  # since is inclusive
