"""Round 11 attack: ``consumerdedup failed replay`` against a Kafka runner with offsets only
in the database (``KafkaConfig(offsets="database", claim_ids=False)``, issue 36).

``failed replay`` promises that a replay killed between a copy's acknowledgement and its
commit on the dead-letter topic doubles nothing: the run after it re-produces the copies
again, and "a twin copy is answered by the dedup record". Offsets only, a copy that was
applied leaves no record: the second copy of each is another record at another offset.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from consumerdedup.adapters.kafka import KafkaConsumerRunner
from tests.conftest import Database
from tests.failed.shop import IDS, KafkaShop, kafka_shop
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)

pytestmark = pytest.mark.postgres


async def consume_offsets_only(shop: KafkaShop) -> None:
    config = shop.kafka.config(
        poll_timeout=timedelta(milliseconds=100), offsets="database", claim_ids=False
    )
    runner = KafkaConsumerRunner(
        shop.handler(),
        shop.topic,
        bootstrap_servers=shop.kafka.bootstrap,
        group_id="shop-" + shop.topic,
        config=config,
    )
    await runner.run(until_idle=True)


async def test_a_replay_killed_before_its_commit_doubles_nothing_with_offsets_only(
    pg: Database, kafka: KafkaService, topics: Topics
) -> None:
    shop = await kafka_shop(pg, kafka, topics, "database")
    await consume_offsets_only(shop)  # the bad deploy: every order FAILED, dead-lettered
    assert shop.outcomes() == dict.fromkeys(IDS, "failed") and shop.applied() == []
    shop.field = "item"  # the fix
    shop.replay_killed_after(3)  # three copies acknowledged, no offset committed on the DLQ
    await consume_offsets_only(shop)
    assert shop.applied() == IDS[:3]
    done = shop.run(*shop.replay_args(), "--yes")  # all five go again
    assert done.returncode == 0, done.stderr
    await consume_offsets_only(shop)
    assert shop.applied() == IDS  # each once
