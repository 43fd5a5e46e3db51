"""Issue 38 item 2: ``Pruner(consumers="payments")`` prunes the consumer named ``payments``,
never consumers named after its letters ("p", "a", "y", ...); options that would change
meaning silently are refused before anything is deleted."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from consumerdedup import ConfigurationError, Pruner
from tests.conftest import Database
from tests.prune.test_pruner import NOW, add_events, clock, survivors

OLD = NOW - timedelta(days=30)


def test_a_string_is_one_consumer(db: Database) -> None:
    add_events(db, [(c, f"{c}-old", OLD) for c in ("payments", "p", "a", "y")])
    pruner = Pruner(db.engine, timedelta(days=7), consumers="payments", tables=db.tables)
    pruner.clock = clock
    report = pruner.run_once()
    assert report.deleted == {"payments": 1}
    assert survivors(db) == {"p-old", "a-old", "y-old"}  # the letters' consumers untouched


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"windows": ["a"]}, "PrunerConfig.windows"),
        ({"dry_run": "false"}, "PrunerConfig.dry_run"),
        ({"consumers": {"payments": 1}}, "PrunerConfig.consumers"),
        ({"consumers": b"payments"}, "PrunerConfig.consumers"),
        ({"batch_size": 1.5}, "PrunerConfig.batch_size"),
        ({"batch_pause": 1}, "PrunerConfig.batch_pause"),
    ],
)
def test_a_wrong_option_deletes_nothing(db: Database, options: dict[str, Any], named: str) -> None:
    add_events(db, [("payments", "payments-old", OLD)])
    with pytest.raises(ConfigurationError, match=named):
        Pruner(db.engine, timedelta(days=7), tables=db.tables, **options)
    assert survivors(db) == {"payments-old"}
