"""A Kafka record as a Message, for hand-written loops (``process_once``).

Takes a confluent-kafka ``Message`` (whose fields are methods) or an aiokafka
``ConsumerRecord`` (attributes). The id is the one the Kafka runner gives the same
record (adapters/kafka/convert.py), so a loop and the runner agree on every key: the
``id_header`` header (``event_id``, what the outbox sets) when present, else the record's
coordinates ``topic:partition:offset`` (``sha256:<hex of the topic>:partition:offset``
past MAX_ID_LENGTH). A header that is present but unusable (empty, not UTF-8) is passed on
as found and the pipeline refuses it (FAILED, InvalidMessage): never the coordinates.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import Any

from ..headers import ID_HEADER
from ..message import MAX_ID_LENGTH, Message
from ..options import text

__all__ = ["kafka_message", "record_coordinates_id"]


def _field(record: Any, name: str) -> Any:
    value = getattr(record, name)
    return value() if callable(value) else value  # confluent-kafka: methods


def record_coordinates_id(topic: str, partition: int, offset: int) -> str:
    """``topic:partition:offset``, or its sha256 form when longer than MAX_ID_LENGTH."""
    readable = f"{topic}:{partition}:{offset}"
    if len(readable) <= MAX_ID_LENGTH:
        return readable
    digest = hashlib.sha256(topic.encode()).hexdigest()
    return f"sha256:{digest}:{partition}:{offset}"


def kafka_message(record: Any, *, id_header: str = ID_HEADER) -> Message:
    """The Message of a confluent-kafka or aiokafka record (see the module's docstring)."""
    id_header = text(id_header, "kafka_message(id_header)")
    topic, partition, offset = (_field(record, n) for n in ("topic", "partition", "offset"))
    headers: dict[str, str] = {}
    message_id: str | bytes | None = None
    for name, value in _field(record, "headers") or ():
        headers[name] = (value or b"").decode("utf-8", errors="backslashreplace")
        if name == id_header:  # the last one wins, as the runner reads it
            message_id = _header_id(value or b"")
    if message_id is None:
        message_id = record_coordinates_id(topic, partition, offset)
    value = _field(record, "value")
    return Message(
        id=message_id,
        body=value if value is not None else b"",
        headers=headers,
        source=topic,
        partition=partition,
        offset=offset,
        timestamp=_timestamp(_field(record, "timestamp")),
        raw=record,
    )


def _header_id(value: bytes) -> str | bytes:
    """The id header's text; bytes that are not UTF-8 stay bytes, which the pipeline refuses
    (FAILED, InvalidMessage) as the runner refuses them, rather than a made-up text."""
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value


def _timestamp(stamp: Any) -> datetime | None:
    if isinstance(stamp, tuple):  # confluent-kafka: (timestamp type, milliseconds)
        stamp = stamp[1]
    if not isinstance(stamp, int) or stamp < 0:
        return None
    try:
        return datetime.fromtimestamp(stamp / 1000, UTC)
    except (OverflowError, OSError, ValueError):
        return None
