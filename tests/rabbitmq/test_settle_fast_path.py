"""The runner's settling without a broker: a clean batch is acked at once only when no RETRY
is remembered (RetrySchedule.empty), and a settled message's backoff starts anew; a
Delivery stays immutable."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
from pika.spec import Basic, BasicProperties  # type: ignore[import-untyped]

from consumerdedup import Message
from consumerdedup.adapters.rabbitmq.convert import Delivery
from consumerdedup.adapters.rabbitmq.retry_later import RetrySchedule
from consumerdedup.retry import Backoff


def schedule() -> RetrySchedule:
    return RetrySchedule(Backoff(timedelta(seconds=1), timedelta(seconds=8), jitter=False))


def test_a_schedule_is_empty_until_a_retry_and_again_once_it_is_settled() -> None:
    retries, message = schedule(), Message(id="m-1", body=b"{}")
    assert retries.empty
    assert retries.delay([message]) == 1.0
    assert retries.delay([message]) == 2.0  # its second RETRY in a row
    assert not retries.empty  # a clean batch now takes the loop that settles each message
    retries.settled(message)
    assert retries.empty
    assert retries.delay([message]) == 1.0  # settled: its backoff starts anew


def test_settling_another_message_keeps_a_remembered_retry() -> None:
    retries = schedule()
    retries.delay([Message(id="m-1", body=b"{}")])
    retries.settled(Message(id="m-2", body=b"{}"))
    assert not retries.empty
    assert retries.delay([Message(id="m-1", body=b"{}")]) == 2.0


def test_a_delivery_is_immutable_and_reads_its_tag() -> None:
    delivery = Delivery(Basic.Deliver(delivery_tag=7), BasicProperties(message_id="x"), b"{}")
    assert delivery.tag == 7
    assert delivery.body == b"{}" and delivery.properties.message_id == "x"
    with pytest.raises(AttributeError):
        delivery.body = b"changed"  # type: ignore[misc]
    assert not dataclasses.is_dataclass(delivery)  # a NamedTuple: nothing to replace() on it
