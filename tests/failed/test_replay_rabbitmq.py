"""A bad deploy on RabbitMQ, recovered with ``consumerdedup failed list`` and ``failed replay``
run for real in a subprocess: every message applied once, the DLQ empty, and a replay killed
with SIGKILL between a confirmed copy and its ack loses nothing and doubles nothing."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Database, database
from tests.failed.shop import IDS, RabbitShop
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401


def wait_for(shop: RabbitShop, queue: str, count: int) -> None:
    """Until the broker holds ``count`` ready in ``queue`` (a killed client's unacked
    messages come back once the broker sees its socket close)."""
    deadline = time.monotonic() + 30
    while shop.rabbit.ready(queue) != count:
        assert time.monotonic() < deadline, (queue, shop.rabbit.ready(queue), count)
        time.sleep(0.05)


@pytest.fixture(params=["postgresql", "mariadb"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """The shop's database: PostgreSQL, and MariaDB (issue 34: the same tools on MySQL)."""
    yield from database(request, request.param, tmp_path)


@pytest.fixture
def shop(db: Database, rabbit: Broker) -> RabbitShop:
    shop = RabbitShop(db, rabbit)
    shop.consume()  # the bad deploy: every order FAILED, dead-lettered
    assert shop.outcomes() == dict.fromkeys(IDS, "failed")
    assert shop.rabbit.ready(shop.queue + ".dlq") == 5 and shop.applied() == []
    return shop


def test_a_bad_deploy_recovered_with_failed_replay(shop: RabbitShop) -> None:
    listed = shop.run("list", "--consumer", "shop")
    assert listed.returncode == 0, listed.stderr
    assert sum("KeyError" in line for line in listed.stdout.splitlines()) == 5
    as_json = json.loads(shop.run("list", "--json", "--limit", "2").stdout)
    assert [r["message_id"] for r in as_json["records"]] == IDS[:2] and as_json["next_cursor"]
    # Replayed before the fix: they simply fail again and are dead-lettered again.
    again = shop.run(*shop.replay_args(), "--yes")
    assert again.returncode == 0, again.stderr
    shop.consume()
    assert shop.outcomes() == dict.fromkeys(IDS, "failed") and shop.applied() == []
    assert shop.rabbit.ready(shop.queue + ".dlq") == 5
    shop.field = "item"  # the fix
    dry = shop.run(*shop.replay_args(), "--dry-run")
    assert "would replay 5 dead letter(s)" in dry.stdout, dry.stdout
    assert shop.rabbit.ready(shop.queue + ".dlq") == 5 and shop.rabbit.ready(shop.queue) == 0
    refused = shop.run(*shop.replay_args(), stdin="n\n")
    assert refused.returncode == 1 and "not confirmed" in refused.stderr
    done = shop.run(*shop.replay_args(), "--yes")
    assert done.returncode == 0, done.stderr
    assert "replayed 5 dead letter(s)" in done.stdout and "forgot 5 FAILED" in done.stdout
    assert shop.rabbit.ready(shop.queue + ".dlq") == 0
    copies = shop.rabbit.peek(shop.queue)
    assert [p.message_id for p, _ in copies] == IDS
    assert all(p.headers == {"trace": p.message_id} for p, _ in copies)  # ours stripped
    shop.consume()
    assert shop.applied() == IDS and shop.outcomes() == dict.fromkeys(IDS, "processed")
    assert shop.rabbit.ready(shop.queue + ".dlq") == 0
    assert shop.run("list").stdout == "no FAILED records\n"


def test_a_replay_killed_halfway_loses_nothing_and_doubles_nothing(shop: RabbitShop) -> None:
    shop.field = "item"
    dlq = shop.queue + ".dlq"
    shop.replay_killed_after(2)
    # The second copy was confirmed and not acked: it is both in the queue and in the DLQ.
    wait_for(shop, dlq, 4)
    assert shop.rabbit.ready(shop.queue) == 2
    shop.consume()  # the two copies apply; their records complete
    assert shop.applied() == IDS[:2]
    done = shop.run(*shop.replay_args(), "--yes")
    assert done.returncode == 0, done.stderr
    # The killed run forgot its whole batch's records first; order-2's dead letter is
    # replayed again, its copy answered from its completed record (never forgotten).
    assert "replayed 4 dead letter(s)" in done.stdout and "forgot 0 FAILED" in done.stdout
    assert shop.rabbit.ready(dlq) == 0
    shop.consume()
    assert shop.applied() == IDS and shop.outcomes() == dict.fromkeys(IDS, "processed")
    assert shop.rabbit.ready(dlq) == 0 and shop.rabbit.ready(shop.queue) == 0
