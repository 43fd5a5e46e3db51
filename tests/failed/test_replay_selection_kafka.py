"""``failed replay --kafka`` picks a subset (issue 38, item 10): a letter the filters pass
over stays readable (the replay group's offset never moves past it), a letter without a
record is counted, kept under ``--only-recorded``, and the exit code says what was done."""

from __future__ import annotations

import pytest

from consumerdedup.failed import forget
from tests.conftest import Database
from tests.failed.shop import IDS, KafkaShop, kafka_shop
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)


@pytest.fixture
async def shop(pg: Database, kafka: KafkaService, topics: Topics) -> KafkaShop:
    """The five orders FAILED and dead-lettered; order-1's record since forgotten."""
    shop = await kafka_shop(pg, kafka, topics)
    await shop.consume()
    assert shop.outcomes() == dict.fromkeys(IDS, "failed")
    assert forget(pg.engine, "shop", ["order-1"], tables=pg.tables) == ["order-1"]
    return shop


def summary(done: object) -> str:
    return str(getattr(done, "stdout", "")).splitlines()[-1]


async def test_a_subset_replayed_and_what_it_passed_over_is_read_again(shop: KafkaShop) -> None:
    shop.field = "item"  # the fix
    dry = shop.run(*shop.replay_args(), "--error-type", "KeyError", "--dry-run")
    assert dry.returncode == 0 and "(1 without any record)" in summary(dry), dry.stdout
    assert summary(dry).startswith("would replay 5 dead letter(s)")
    limited = shop.run(*shop.replay_args(), "--since", "1d", "--limit", "2", "--dry-run")
    assert summary(limited).startswith("would replay 2 dead letter(s)"), limited.stdout
    assert "would replay shop order-2 " in limited.stdout and "order-4" not in limited.stdout

    # order-1 has no record, so no time: --since passes it over, and the offset stays there.
    some = shop.run(*shop.replay_args(), "--since", "1d", "--yes")
    assert some.returncode == 0, some.stderr
    assert summary(some).startswith("replayed 4 dead letter(s)"), some.stdout
    assert "1 not selected by the filters" in summary(some)
    await shop.consume()
    assert shop.applied() == IDS[1:]

    # order-1 first in the partition, and kept: nothing done, exit 1.
    nothing = shop.run(*shop.replay_args(), "--only-recorded", "--yes")
    assert nothing.returncode == 1, (nothing.stdout, nothing.stderr)
    assert "order-1: no record of it" in nothing.stdout

    rest = shop.run(*shop.replay_args(), "--yes")  # read again from order-1
    assert rest.returncode == 0, rest.stderr
    assert (
        summary(rest).startswith("replayed 5 dead letter(s)") and "forgot 0 FAILED" in rest.stdout
    )
    assert "(1 without any record)" in summary(rest)
    await shop.consume()  # order-1 applies; the others' copies are answered by their records
    assert shop.applied() == IDS and shop.outcomes() == dict.fromkeys(IDS, "processed")
    again = shop.run(*shop.replay_args(), "--yes")
    assert summary(again).startswith("replayed 0 dead letter(s)"), again.stdout


async def test_a_replay_partly_done_exits_3(shop: KafkaShop, pg: Database) -> None:
    shop.field = "item"
    # order-3's record forgotten too; from order-2 on: order-2 goes, order-3 is kept (no
    # record) and stops the partition there.
    assert forget(pg.engine, "shop", ["order-3"], tables=pg.tables) == ["order-3"]
    partly = shop.run(*shop.replay_args(), "--only-recorded", "--from-offset", "1", "--yes")
    assert partly.returncode == 3, (partly.stdout, partly.stderr)
    assert summary(partly).startswith("replayed 1 dead letter(s)") and "1 kept" in partly.stdout
    assert "order-3: no record of it" in partly.stdout
