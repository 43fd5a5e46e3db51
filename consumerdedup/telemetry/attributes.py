"""The OpenTelemetry messaging semantic conventions' names, as consumerdedup fills them.

The conventions are at status Development: these are the current names. With
``OTEL_SEMCONV_STABILITY_OPT_IN`` holding ``messaging/dup`` the names they replaced
are set too (``messaging.operation``, ``messaging.kafka.destination.partition``,
``messaging.kafka.consumer.group``), for dashboards that still read them.
"""

from __future__ import annotations

import os
from typing import Any

from ..message import Message

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10)
"""The conventions' advice for messaging.process.duration and operation.duration (s)."""


def _opted_in() -> bool:
    return "messaging/dup" in os.environ.get("OTEL_SEMCONV_STABILITY_OPT_IN", "").split(",")


_DUP = _opted_in()
"""Read once, at import: the environment is the process's setting, not a message's."""


def system_of(message: Message) -> str:
    """kafka, rabbitmq or memory, from the broker's own object the adapter kept."""
    raw = message.raw
    if raw is not None and hasattr(getattr(raw, "method", None), "delivery_tag"):
        return "rabbitmq"
    if raw is not None and hasattr(raw, "topic") and hasattr(raw, "partition"):
        return "kafka"
    return "memory"


def publisher_system(publisher: object) -> str:
    """kafka or rabbitmq for our publishers; another's class name, lowercased."""
    name = type(publisher).__name__.lower()
    if "kafka" in name:
        return "kafka"
    return "rabbitmq" if "rabbit" in name else name.removesuffix("publisher") or name


def consumer_attributes(message: Message, consumer: str) -> dict[str, Any]:
    """A process span's attributes for one message (never its body or headers)."""
    system = system_of(message)
    found: dict[str, Any] = {
        "messaging.system": system,
        "messaging.operation.name": "process",
        "messaging.operation.type": "process",
        "messaging.destination.name": message.source,
        "messaging.consumer.group.name": consumer,
        "consumerdedup.consumer": consumer,
    }
    if isinstance(message.id, str):
        found["messaging.message.id"] = message.id
    if system == "kafka" and message.partition is not None:
        found["messaging.destination.partition.id"] = str(message.partition)
        if message.offset is not None:
            found["messaging.kafka.offset"] = message.offset
    if system == "rabbitmq":
        found["messaging.rabbitmq.message.delivery_tag"] = message.raw.method.delivery_tag
    if _DUP:
        found["messaging.operation"] = "process"
        if "messaging.destination.partition.id" in found:
            found["messaging.kafka.destination.partition"] = message.partition
        if system == "kafka":
            found["messaging.kafka.consumer.group"] = consumer
    return found


def producer_attributes(system: str, destination: str, event_id: str | None) -> dict[str, Any]:
    found: dict[str, Any] = {
        "messaging.system": system,
        "messaging.operation.name": "send",
        "messaging.operation.type": "send",
        "messaging.destination.name": destination,
    }
    if event_id:
        found["messaging.message.id"] = event_id
    if _DUP:
        found["messaging.operation"] = "publish"
    return found
