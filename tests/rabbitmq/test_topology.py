"""A queue's topology without a runner: declare it (as RabbitConfig(declare=True) would at
start), and find which queues are missing."""

from __future__ import annotations

from consumerdedup.adapters.rabbitmq import RabbitConfig
from consumerdedup.adapters.rabbitmq.topology import declare, missing_queues
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401


def test_declare_makes_the_queue_and_its_dead_letter_queue(rabbit: Broker) -> None:
    queue = rabbit.name("declared")
    assert missing_queues([queue, queue + ".dlq"], url=rabbit.url) == [queue, queue + ".dlq"]
    declare(queue, url=rabbit.url, config=RabbitConfig(declare=True))
    declare(queue, url=rabbit.url, config=RabbitConfig(declare=True))  # idempotent
    assert missing_queues([queue, queue + ".dlq"], url=rabbit.url) == []
    # What the runner's dead letters need: a message rejected by the queue goes to the DLQ.
    rabbit.publish(queue, b"{}", message_id="m-1")
    channel = rabbit.connection.channel()
    method, _, _ = channel.basic_get(queue)
    channel.basic_nack(method.delivery_tag, requeue=False)
    assert rabbit.reaches(queue + ".dlq", 1) == 1
