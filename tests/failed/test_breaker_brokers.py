"""The circuit breaker on real brokers (issue 38 item 6): a broken deploy on RabbitMQ and on
Kafka (Tansu) stops its runner after ``breaker_threshold`` FAILED in a row, the messages it
did not take stay with the broker (not acked, offsets not committed), and after the fix a
new runner plus ``consumerdedup failed replay`` (run for real) applies every order exactly
once: rows in the business table and processed_events."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from consumerdedup import Deduplicator, RetryPolicy
from consumerdedup.adapters.kafka import KafkaConsumerRunner
from consumerdedup.adapters.rabbitmq import RabbitConfig, RabbitConsumerRunner
from consumerdedup.errors import CircuitOpen
from tests.conftest import Database
from tests.failed.shop import IDS, KafkaShop, RabbitShop, Shop, kafka_shop, order
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401

MORE = [f"order-{n}" for n in range(6, 13)]
ALL = IDS + MORE
"""Twelve orders: the three that trip the breaker, nine it must leave alone."""
TRIPPED = ALL[:3]


def tripping(shop: Shop) -> None:
    """The shop's deduplicator with one attempt a message and a breaker at 3."""
    zero = timedelta(0)
    retry = RetryPolicy(attempts=1, initial_delay=zero, max_delay=zero, breaker_threshold=3)
    shop.dedup = Deduplicator(shop.db.engine, consumer="shop", tables=shop.db.tables, retry=retry)


def until(condition: object, what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_rabbitmq_a_broken_deploy_stops_then_fix_and_replay_apply_all_once(
    pg: Database, rabbit: Broker
) -> None:
    shop = RabbitShop(pg, rabbit)
    for n, message_id in enumerate(MORE, 6):
        rabbit.publish(shop.queue, order(n), message_id, headers={"trace": message_id})
    tripping(shop)
    config = RabbitConfig(idle_timeout=timedelta(milliseconds=300), retry_delay=timedelta(0))
    runner = RabbitConsumerRunner(shop.handler(), shop.queue, url=rabbit.url, config=config)
    with pytest.raises(CircuitOpen, match="3 messages in a row failed with KeyError"):
        runner.run(until_idle=True)
    assert runner.breaker.open and not runner.ready
    dlq = shop.queue + ".dlq"
    # Not taken, or taken and not tried: all still the broker's once the runner is gone.
    assert rabbit.held(shop.queue) == 9
    assert rabbit.ready(dlq) == 3
    assert sorted(p.message_id for p, _ in rabbit.peek(shop.queue)) == sorted(ALL[3:])
    assert shop.outcomes() == dict.fromkeys(TRIPPED, "failed") and shop.applied() == []

    shop.field = "item"  # the fix; the orchestrator starts the consumer again
    shop.consume()
    assert shop.applied() == sorted(ALL[3:])
    done = shop.run(*shop.replay_args(), "--yes")
    assert done.returncode == 0, done.stderr
    assert "replayed 3 dead letter(s)" in done.stdout, done.stdout
    shop.consume()
    assert shop.applied() == sorted(ALL)  # each order once: no unique key on the ledger
    assert shop.outcomes() == dict.fromkeys(ALL, "processed")
    assert rabbit.ready(dlq) == 0 and rabbit.held(shop.queue) == 0


async def test_kafka_a_broken_deploy_stops_then_fix_and_replay_apply_all_once(
    pg: Database, kafka: KafkaService, topics: Topics
) -> None:
    shop: KafkaShop = await kafka_shop(pg, kafka, topics)
    for n, message_id in enumerate(MORE, 6):
        await topics.produce(shop.topic, order(n), event_id=message_id, headers=[("trace", b"t")])
    tripping(shop)
    group = "shop-" + shop.topic
    runner = KafkaConsumerRunner(
        shop.handler(),
        shop.topic,
        bootstrap_servers=kafka.bootstrap,
        group_id=group,
        config=kafka.config(poll_timeout=timedelta(milliseconds=100)),
    )
    with pytest.raises(CircuitOpen, match="3 messages in a row failed with KeyError"):
        await runner.run(until_idle=True)
    assert runner.breaker.open and not runner.ready
    # The group committed past the three dead-lettered records only: nine still to read.
    assert await topics.committed(group, shop.topic) == {0: 3}
    assert await topics.lag(group, shop.topic) == 9
    assert len(await topics.records(shop.topic + ".dlq")) == 3
    assert shop.outcomes() == dict.fromkeys(TRIPPED, "failed") and shop.applied() == []

    shop.field = "item"
    await shop.consume()
    assert shop.applied() == sorted(ALL[3:])
    done = shop.run(*shop.replay_args(), "--yes")
    assert done.returncode == 0, done.stderr
    assert "replayed 3 dead letter(s)" in done.stdout, done.stdout
    await shop.consume()
    assert shop.applied() == sorted(ALL)
    assert shop.outcomes() == dict.fromkeys(ALL, "processed")
