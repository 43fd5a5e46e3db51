"""A bad deploy on Kafka (Tansu), recovered with ``failed replay --kafka``: the dead-letter
topic's records re-produced to their source topic, the replay group's offsets on the DLQ
committed after; a replay killed between a copy's ack and the commit doubles nothing. With
the runner's offsets in the broker and in the database (issue 36)."""

from __future__ import annotations

import pytest

from tests.conftest import Database
from tests.failed.shop import IDS, KafkaShop, kafka_shop
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)


@pytest.fixture(params=["broker", "database"])
async def shop(
    request: pytest.FixtureRequest, pg: Database, kafka: KafkaService, topics: Topics
) -> KafkaShop:
    shop = await kafka_shop(pg, kafka, topics, request.param)
    await shop.consume()  # the bad deploy: every order FAILED, dead-lettered
    assert shop.outcomes() == dict.fromkeys(IDS, "failed") and shop.applied() == []
    assert len(await topics.records(shop.topic + ".dlq")) == 5
    return shop


async def test_a_bad_deploy_recovered_with_failed_replay_kafka(
    shop: KafkaShop, topics: Topics
) -> None:
    shop.field = "item"  # the fix
    done = shop.run(*shop.replay_args(), "--yes")
    assert done.returncode == 0, done.stderr
    assert "replayed 5 dead letter(s)" in done.stdout and "forgot 5 FAILED" in done.stdout
    copies = (await topics.records(shop.topic))[5:]
    assert [dict(r.headers)["event_id"].decode() for r in copies] == IDS
    assert all(not k.startswith("x-dead-letter-") for r in copies for k, _ in r.headers)
    await shop.consume()
    assert shop.applied() == IDS and shop.outcomes() == dict.fromkeys(IDS, "processed")
    assert len(await topics.records(shop.topic + ".dlq")) == 5  # a topic keeps its records
    again = shop.run(*shop.replay_args(), "--yes")  # the group's committed offsets: nothing left
    assert "replayed 0 dead letter(s)" in again.stdout, again.stdout


async def test_a_replay_killed_before_its_commit_doubles_nothing(shop: KafkaShop) -> None:
    """SIGKILL after the third copy was acknowledged: no offset was committed yet."""
    shop.field = "item"
    shop.replay_killed_after(3)
    await shop.consume()  # the three copies apply
    assert shop.applied() == IDS[:3]
    done = shop.run(*shop.replay_args(), "--yes")
    # Nothing was committed: all five go again; the three completed records are kept
    # (the killed run had forgotten its whole batch first).
    assert "replayed 5 dead letter(s)" in done.stdout and "forgot 0 FAILED" in done.stdout
    await shop.consume()
    assert shop.applied() == IDS and shop.outcomes() == dict.fromkeys(IDS, "processed")
