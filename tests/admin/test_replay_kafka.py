"""Replay from the admin page through Kafka (Tansu), on the real server and PostgreSQL:
the chosen FAILED records' dead letters re-produced to their topic (the others left for
a later replay), the fixed consumer processes them, the records leave the list."""

from __future__ import annotations

import httpx
import pytest

from consumerdedup.admin import Grant, KafkaReplay, Role, admin_app
from tests.admin.server import Audits, served
from tests.conftest import Database
from tests.failed.shop import IDS, KafkaShop, kafka_shop
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)

OPERATOR = Grant(Role.OPERATOR, "ops@example.com")


@pytest.fixture
async def shop(pg: Database, kafka: KafkaService, topics: Topics) -> KafkaShop:
    shop = await kafka_shop(pg, kafka, topics)
    await shop.consume()  # the bad deploy: every order FAILED, dead-lettered
    assert shop.outcomes() == dict.fromkeys(IDS, "failed")
    return shop


async def test_chosen_records_replayed_through_kafka(shop: KafkaShop, kafka: KafkaService) -> None:
    audits = Audits()
    replay = KafkaReplay(kafka.bootstrap, {"shop": shop.topic + ".dlq"})
    app = admin_app(
        shop.db.engine,
        tables=shop.db.tables,
        authorize=lambda request: OPERATOR,
        actions=True,
        replay=replay,
        audit=audits,
    )
    shop.field = "item"  # the fix
    with served(app) as base, httpx.Client() as client:
        csrf = client.get(f"{base}/failures.json").json()["csrf"]
        form = {"action": "replay", "scope": "selected", "csrf": csrf, "confirm": "yes"}
        form |= {"why": "fixed", "key": [f'["shop", "{i}"]' for i in IDS[:3]]}
        done = client.post(f"{base}/failures/apply.json", data=form)
        assert done.status_code == 200 and done.json()["count"] == 3, done.text
        left = client.get(f"{base}/failures.json", params={"consumer": "shop"}).json()
        assert [r["message_id"] for r in left["records"]] == IDS[3:]
    await shop.consume()
    assert shop.applied() == IDS[:3]
    expected = {**dict.fromkeys(IDS[:3], "processed"), **dict.fromkeys(IDS[3:], "failed")}
    assert shop.outcomes() == expected
    [entry] = audits
    assert (entry.action, entry.count, sorted(entry.ids)) == ("failed.replay", 3, IDS[:3])
