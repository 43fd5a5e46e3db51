"""``Pruner(engine, None, windows=...)`` on a partitioned processed_events drops no partition.

retention=None keeps every consumer without a window of its own forever, and a day
partition holds every consumer's rows: dropping it would take theirs too. The README:
"A consumer kept forever, a round restricted with consumers=[...], or retention=None
means no drops at all, only row deletes." (tests/prune/test_partitions.py covers the first two.)
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from tests.conftest import Database
from tests.prune.test_partitions import day_names, every_six_hours, make_days
from tests.prune.test_pruner import DAY, NOW, add_events, pruner, survivors

pytestmark = pytest.mark.postgres


def test_retention_none_drops_no_partition_and_keeps_the_unnamed_consumers(
    pg_partitioned: Database,
) -> None:
    db = pg_partitioned
    make_days(db, (NOW - 20 * DAY).date(), 21)
    consumers = ("ledger", "audit", "mail")  # mail has no window: kept forever
    add = [row for name in consumers for row in every_six_hours(name, 20)]

    add_events(db, add)
    days = day_names(db)
    windows = {"ledger": timedelta(days=7), "audit": timedelta(days=1)}

    dry = pruner(db, None, windows=windows, dry_run=True).run_once()
    assert dry.partitions == ()

    report = pruner(db, None, windows=windows).run_once()

    assert report.partitions == ()
    assert day_names(db) >= days  # every old day is still there (and the days ahead made)
    assert survivors(db, "mail") == {i for _, i, _ in every_six_hours("mail", 20)}
    assert survivors(db, "ledger") == {
        i for _, i, at in every_six_hours("ledger", 20) if at >= NOW - 8 * DAY
    }
    assert survivors(db, "audit") == {
        i for _, i, at in every_six_hours("audit", 20) if at >= NOW - 2 * DAY
    }
    gone = 20 * 4 - len(survivors(db, "ledger")), 20 * 4 - len(survivors(db, "audit"))
    assert (report.deleted["ledger"], report.deleted["audit"]) == gone
    assert "mail" not in report.deleted
