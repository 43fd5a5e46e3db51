"""PrunerConfig and the window arithmetic: validated once, frozen, and the same as the shortcut."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import create_engine

from consumerdedup import ConfigurationError, Pruner
from consumerdedup.prune import PrunerConfig
from consumerdedup.prune.windows import BrokerRetention, Cutoffs, Keep, SourceRetention
from tests.conftest import Database
from tests.prune.test_pruner import NOW, add_events, clock, survivors

DAY = timedelta(days=1)
WEEK = timedelta(days=7)


def test_the_config_and_the_keyword_shortcut_prune_the_same_rows(db: Database) -> None:
    rows = [(c, f"{c}-{age}", NOW - age * DAY) for c in ("ledger", "audit") for age in range(40)]
    add_events(db, rows)
    windows = {"audit": timedelta(days=30)}
    config = PrunerConfig(WEEK, DAY, windows=windows, batch_size=7, dry_run=True)
    by_config = Pruner(db.engine, config=config, tables=db.tables, clock=clock).run_once()
    by_keywords = Pruner(
        db.engine, WEEK, DAY, windows=windows, batch_size=7, dry_run=True, tables=db.tables
    )
    by_keywords.clock = clock
    assert by_keywords.config == config
    assert by_config.deleted == by_keywords.run_once().deleted == {"ledger": 31, "audit": 8}
    assert len(survivors(db)) == 80  # dry runs both

    real = Pruner(db.engine, config=dataclasses.replace(config, dry_run=False), tables=db.tables)
    real.clock = clock
    assert real.run_once().deleted == by_config.deleted
    assert len(survivors(db)) == 80 - 31 - 8


def test_config_and_settings_together_are_refused() -> None:
    engine = create_engine("sqlite://")
    config = PrunerConfig(WEEK)
    for mixed in ({"retention": WEEK}, {"buffer": DAY}, {"batch_size": 10}):
        with pytest.raises(ConfigurationError, match="not both"):
            Pruner(engine, config=config, **mixed)
    with pytest.raises(TypeError, match="needs a retention"):
        Pruner(engine)
    with pytest.raises(TypeError, match="windos"):
        Pruner(engine, WEEK, windos={"a": DAY})  # type: ignore[call-arg]


def test_the_config_is_validated_at_construction_and_frozen() -> None:
    with pytest.raises(
        ConfigurationError,
        match=r"PrunerConfig.batch_size: expected an integer >= 1, got True \(bool\)",
    ):
        PrunerConfig(WEEK, batch_size=True)
    config = PrunerConfig(WEEK)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.batch_size = 10  # type: ignore[misc]
    with pytest.raises(
        ConfigurationError, match=r"PrunerConfig.outbox_keep: expected a timedelta > 0"
    ):
        dataclasses.replace(config, outbox_keep=timedelta(0))  # replace validates again


def test_consumers_and_windows_are_copied_not_shared() -> None:
    windows: dict[str, timedelta | None] = {"audit": 30 * DAY}
    config = PrunerConfig(WEEK, windows=windows, consumers=iter(["mail", "ledger", "mail"]))
    windows["audit"] = DAY
    assert config.consumers == ("ledger", "mail")
    assert config.windows == {"audit": 30 * DAY}
    assert config.keep == Keep({"ledger": 8 * DAY, "mail": 8 * DAY}, None)


def test_keep_is_each_window_plus_its_buffer() -> None:
    found = BrokerRetention.of("kafka", [SourceRetention("t", 2 * DAY, "retention.ms")])
    config = PrunerConfig(30 * DAY, windows={"legal": None, "fast": found, "slow": 100 * DAY})
    assert config.keep == Keep({"fast": 3 * DAY, "legal": None, "slow": 110 * DAY}, 33 * DAY)
    fixed = PrunerConfig(30 * DAY, timedelta(hours=1), windows={"fast": found})
    assert fixed.keep == Keep({"fast": 2 * DAY + timedelta(hours=1)}, 30 * DAY + timedelta(hours=1))
    assert PrunerConfig(None, windows={"a": DAY}).keep == Keep({"a": 2 * DAY}, None)


def test_whole_partitions_go_up_to_the_earliest_cutoff_of_all() -> None:
    now = datetime(2025, 6, 1, tzinfo=UTC)
    keep = Keep({"audit": 33 * DAY, "fast": 2 * DAY}, 8 * DAY)
    cutoffs = keep.cutoffs(now)
    assert cutoffs == Cutoffs({"audit": now - 33 * DAY, "fast": now - 2 * DAY}, now - 8 * DAY)
    assert cutoffs.whole_partitions() == now - 33 * DAY
    assert cutoffs.shown == {**cutoffs.named, "*": now - 8 * DAY}
    assert Cutoffs({}, now - DAY).whole_partitions() == now - DAY
    kept_forever = Cutoffs({"legal": None, "fast": now - DAY}, now - DAY)
    assert kept_forever.whole_partitions() is None
    restricted = Keep({"fast": 2 * DAY}, None).cutoffs(now)  # consumers= names the round's
    assert restricted.whole_partitions() is None and restricted.shown == restricted.named


def test_the_plan_says_what_a_round_deletes() -> None:
    config = PrunerConfig(WEEK, windows={"legal": None}, idempotency_keep=timedelta(hours=24))
    assert config.describe() == (
        "deleting what is older than retention + buffer, buffer max(1d, 10%): legal forever, "
        "other consumers 8d; published outbox rows 7d; idempotency keys past their expiry or "
        "older than 1d"
    )
    off = PrunerConfig(WEEK, DAY, consumers=["a"], outbox_keep=None, idempotency_keep=None)
    assert off.describe() == (
        "deleting what is older than retention + buffer: a 8d; outbox left alone; "
        "idempotency keys left alone"
    )
