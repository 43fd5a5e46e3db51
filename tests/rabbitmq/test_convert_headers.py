"""A delivery's headers and timestamp as its Message carries them: text, frozen, never shared."""

from __future__ import annotations

from datetime import UTC, datetime

import pika
import pytest
from pika.spec import Basic

from consumerdedup.adapters.rabbitmq import RabbitConfig
from consumerdedup.adapters.rabbitmq.convert import Delivery, to_message


def convert(properties: pika.BasicProperties) -> tuple[object, str | None]:
    return to_message(
        Delivery(Basic.Deliver(delivery_tag=1), properties, b"{}"), "q", RabbitConfig()
    )


def test_headers_come_as_frozen_text_and_the_timestamp_as_utc() -> None:
    sent = {"trace": "t-1", "attempt": 3, "raw": b"\xff"}
    properties = pika.BasicProperties(message_id="m-1", headers=sent, timestamp=1_700_000_000)
    message, refusal = convert(properties)
    assert refusal is None
    assert dict(message.headers) == {"trace": "t-1", "attempt": "3", "raw": "\ufffd"}
    assert message.timestamp == datetime.fromtimestamp(1_700_000_000, UTC)
    with pytest.raises(TypeError):
        message.headers["trace"] = "changed"  # type: ignore[index]
    sent["trace"] = "changed later"  # the producer's table is not the Message's
    assert message.headers["trace"] == "t-1"


@pytest.mark.parametrize("headers", [None, {}])
def test_a_delivery_without_headers_has_empty_frozen_headers(
    headers: dict[str, str] | None,
) -> None:
    first, _ = convert(pika.BasicProperties(message_id="m-1", headers=headers))
    second, _ = convert(pika.BasicProperties(message_id="m-2", headers={"a": "b"}))
    assert dict(first.headers) == {} and first.timestamp is None
    assert dict(second.headers) == {"a": "b"}  # one delivery's headers never show on another
    with pytest.raises(TypeError):
        first.headers["a"] = "b"  # type: ignore[index]
