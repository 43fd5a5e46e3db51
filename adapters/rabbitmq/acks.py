"""Acknowledging on RabbitMQ, after the database commit: one ``multiple`` ack for a clean
batch; else each decided delivery alone, and the held ones nacked with requeue."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from .convert import Delivery


def ack_all(channel: Any, batch: Sequence[Delivery]) -> None:
    """Every delivery of ``batch``, in one frame: ``multiple`` up to the last tag (the
    channel's tags grow, and every earlier one of this channel was settled already)."""
    channel.basic_ack(batch[-1].tag, multiple=len(batch) > 1)


def ack_decided(channel: Any, batch: Sequence[Delivery], held: Collection[int]) -> bool:
    """Ack each delivery whose tag is not ``held``; True if any was."""
    acked = False
    for delivery in batch:
        if delivery.tag not in held:
            channel.basic_ack(delivery.tag)
            acked = True
    return acked


def requeue(channel: Any, deliveries: Sequence[Delivery]) -> None:
    """Give ``deliveries`` back to the queue, to come again."""
    for delivery in deliveries:
        channel.basic_nack(delivery.tag, requeue=True)
