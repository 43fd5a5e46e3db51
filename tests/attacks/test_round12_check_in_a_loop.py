"""Round 12: ``App.check()`` called from asyncio code (an async test, a FastAPI startup
hook) for a Kafka consumer and the App's pruner.

c739aeb made the Kafka blocking helpers refuse inside a running event loop (no coroutine
left unawaited). App.check() is itself blocking (its database checks block the loop
too), and it calls those helpers: inside a loop the consumer's topics were not asked (a
FAIL whose fix said "set the broker's address") and a pruner window shorter than the
broker's retention was a WARN ("broker not asked"), not the FAIL it is from a thread.
App.check() must answer the same in a loop as out of one.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from typing import Any

import pytest

from consumerdedup import App
from consumerdedup.app import Settings
from tests.conftest import Database
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)

pytestmark = [pytest.mark.postgres, pytest.mark.filterwarnings("error::RuntimeWarning")]


def _app(pg: Database, topic: str, **pruner: Any) -> App:
    app = App(f"loop-{uuid.uuid4().hex[:8]}", database_url=pg.url, tables=pg.tables)

    def handle(message: Any, session: Any) -> None:
        return None

    app.kafka(topics=topic, consumer="c")(handle)
    if pruner:
        app.pruner(every=timedelta(minutes=5), **pruner)
    return app


def _said(found: Any) -> list[tuple[str, str, str, str | None]]:
    return [(c.name, c.status, c.detail, c.fix) for c in found]


@pytest.mark.parametrize(
    "pruner",
    [{}, {"windows": {"c": timedelta(seconds=1)}}, {"retention": timedelta(days=30)}],
    ids=["no-pruner", "window-given", "retention-fallback"],
)
async def test_check_in_a_running_loop_says_what_it_says_from_a_thread(
    pg: Database, kafka: KafkaService, topics: Topics, pruner: dict[str, Any]
) -> None:
    topic = await topics.create("inloop")
    app = _app(pg, topic, **pruner)
    settings = Settings.load(kafka_bootstrap_servers=kafka.bootstrap)
    from_a_thread = await asyncio.to_thread(app.check, settings)
    in_the_loop = app.check(settings)
    assert _said(in_the_loop) == _said(from_a_thread)
    assert not any("event loop" in c.detail for c in in_the_loop), _said(in_the_loop)
