"""Round 11 attack: ``App.check()`` (``consumerdedup run --check``) for a Kafka consumer with
offsets in the database (issue 36). The check says what the app's parts need from the
database; a consumer with ``offsets="database"`` needs consumer_offsets, and the runner
refuses to start without it. Before, the check passed (it asked only for processed_events
and the outbox) and the worker then stopped at start."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from sqlalchemy import text

from consumerdedup import App
from consumerdedup.app import Settings
from consumerdedup.startup import FAIL, OK
from tests.conftest import Database
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)

# A blocking broker check run inside this test's event loop must not leave a coroutine it
# built unawaited ("coroutine 'wait_for' was never awaited" from App.check, before).
pytestmark = [pytest.mark.postgres, pytest.mark.filterwarnings("error::RuntimeWarning")]


async def test_check_names_consumer_offsets_for_a_consumer_with_offsets_in_the_database(
    pg: Database, kafka: KafkaService, topics: Topics
) -> None:
    topic = await topics.create("appcheck")
    app = App(f"offsets-{uuid.uuid4().hex[:8]}", database_url=pg.url, tables=pg.tables)

    def handle(message: Any, session: Any) -> None:
        return None

    app.kafka(topics=topic, consumer="c", offsets="database", claim_ids=False)(handle)
    settings = Settings.load(kafka_bootstrap_servers=kafka.bootstrap)
    found = {c.name: c for c in app.check(settings)}
    assert found["tables"].status == OK
    assert pg.tables.offsets.fullname in found["tables"].detail
    with pg.engine.begin() as conn:
        conn.execute(text(f"DROP TABLE {pg.tables.offsets.fullname}"))
    found = {c.name: c for c in app.check(settings)}
    assert found["tables"].status == FAIL
    assert pg.tables.offsets.fullname in found["tables"].detail
