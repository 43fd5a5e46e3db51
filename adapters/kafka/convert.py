"""Records to Messages, and the headers of a dead-letter copy."""

from __future__ import annotations

import hashlib
from dataclasses import fields, replace
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

from consumerdedup import MAX_ID_LENGTH, Message
from consumerdedup.headers import CONSUMER_HEADER, REASON_HEADER, SOURCE_HEADER
from consumerdedup.reasons import REASON_LIMIT, describe

from .config import KafkaConfig
from .undecodable import Undecodable

PARTITION_HEADER = "x-dead-letter-partition"
OFFSET_HEADER = "x-dead-letter-offset"
"""On a dead letter: where it was in the source topic (decimal text)."""
BODY_DROPPED_HEADER = "x-dead-letter-body-dropped"
"""On a dead letter sent without its body (the value), because the broker refused the full
copy for good: why it refused it."""

OUR_HEADERS = frozenset(
    {REASON_HEADER, CONSUMER_HEADER, SOURCE_HEADER, PARTITION_HEADER, OFFSET_HEADER}
)
"""The headers a dead letter carries of ours (the source's own of these names are dropped)."""


_FIELDS = ("id", "body", "headers", "source", "partition", "offset", "timestamp", "raw")
if tuple(f.name for f in fields(Message)) != _FIELDS:  # pragma: no cover  # caught at import
    raise ImportError(f"Message's fields are not {_FIELDS}: update convert._message")
_new_message = Message.__new__
_set_id, _set_body, _set_headers, _set_source, _set_partition, _set_offset, _set_time, _set_raw = (
    getattr(Message, name).__set__ for name in _FIELDS
)


def _message(
    message_id: Any,
    body: bytes,
    headers: MappingProxyType[str, str],
    source: str,
    partition: int,
    offset: int,
    time: datetime | None,
    raw: Any,
) -> Message:
    """``Message(...)`` with these fields, made the way its frozen ``__init__`` would (its
    ``__post_init__`` has nothing to do for read-only headers), without that ``__init__``'s
    ``object.__setattr__`` per field: a third of the time, once per record."""
    message = _new_message(Message)
    _set_id(message, message_id)
    _set_body(message, body)
    _set_headers(message, headers)
    _set_source(message, source)
    _set_partition(message, partition)
    _set_offset(message, offset)
    _set_time(message, time)
    _set_raw(message, raw)
    return message


def coordinates(record: Any) -> str:
    return f"{record.topic}:{record.partition}:{record.offset}"


def coordinates_id(record: Any) -> str:
    """``topic:partition:offset`` when it fits MAX_ID_LENGTH, else
    ``sha256:<hex of the topic>:partition:offset`` (at most 102 characters).

    Decided per record, so every id that fitted before stays what it was; the two
    forms cannot meet, as a Kafka topic name has no ``:``.
    """
    readable = coordinates(record)
    if len(readable) <= MAX_ID_LENGTH:
        return readable
    digest = hashlib.sha256(record.topic.encode()).hexdigest()
    return f"sha256:{digest}:{record.partition}:{record.offset}"


def to_message(record: Any, config: KafkaConfig) -> tuple[Message, str | None]:
    """The Message of an aiokafka ConsumerRecord, and why it must be refused (None: it need not).

    The id is the ``config.id_header`` header, else what ``config.key`` returns,
    else (``coordinates_as_id``) ``coordinates_id``. A header that is
    present but unusable is refused, never replaced by a fallback.

    Never raises: a record this cannot read is refused with the reason (one record's
    conversion error raising here would stop its partition on every restart).
    """
    if isinstance(record, Undecodable):  # aiokafka could not decode it: nothing to read
        return unreadable(record), record.reason
    try:
        return _converted(record, config)
    except Exception as exc:
        return unreadable(record), f"the record cannot be read: {describe(exc)}"


def unreadable(record: Any) -> Message:
    """A Message of what can surely be taken from ``record``: enough to dead-letter it."""
    value = getattr(record, "value", None)
    topic = getattr(record, "topic", None)
    return Message(
        id=None,
        body=value if isinstance(value, bytes) else b"",
        source=topic if isinstance(topic, str) else "",
        partition=_int_or_none(getattr(record, "partition", None)),
        offset=_int_or_none(getattr(record, "offset", None)),
        raw=record,
    )


_BYTES_OR_NONE = (bytes, type(None))
"""``bytes | None`` for isinstance, as a tuple: the same test, read faster."""


def _converted(record: Any, config: KafkaConfig) -> tuple[Message, str | None]:
    headers: dict[str, str] = {}
    raw_id: bytes | None = None
    id_header = config.id_header
    for name, value in record.headers:
        if not isinstance(name, str) or not isinstance(value, _BYTES_OR_NONE):
            raise TypeError(
                f"a header is not (str, bytes): {type(name).__name__}, {type(value).__name__}"
            )
        # Non-UTF-8 header values stay readable, and intact in ``raw.headers``.
        headers[name] = (value or b"").decode("utf-8", errors="backslashreplace")
        if name == id_header:  # the last one wins, as in the Java client's lastHeader()
            raw_id = value or b""
    value = record.value
    if not isinstance(value, bytes | None):
        raise TypeError(f"the value is a {type(value).__name__}, not bytes")
    # The id is known before the Message is made, so it is made once, except on the key
    # function's path (called with the Message, without an id).
    message_id, refusal = _header_id(raw_id, config)
    if message_id is None and refusal is None and config.key is None and config.coordinates_as_id:
        message_id = coordinates_id(record)
    message = _message(
        message_id,
        value if value is not None else b"",
        # Read-only already: Message keeps it as it is, without a copy (the dict is ours).
        MappingProxyType(headers),
        record.topic,
        record.partition,
        record.offset,
        timestamp(record.timestamp),
        record,
    )
    if message_id is None and refusal is None:
        message, refusal = _with_key(message, record, config)
    if refusal is None and record.value is None:
        refusal = "the record has a null value (a tombstone): there is nothing to process"
    return message, refusal


_last_time: tuple[int, datetime] = (-1, datetime.fromtimestamp(0, UTC))
"""The last (milliseconds, time) made: consecutive records of a partition mostly share their
millisecond (a producer's batch; 9395 of 10000 in bench_kafka.py's fill), and a datetime is
immutable. One tuple, swapped whole: a thread reading it sees one pair or the other."""


def timestamp(milliseconds: Any) -> datetime | None:
    """The record's time; None where there is none (-1) or Python cannot hold it (any int64
    is a valid CreateTime): the record is not at fault, ``raw.timestamp`` keeps it."""
    global _last_time
    if not isinstance(milliseconds, int) or milliseconds < 0:
        return None
    last = _last_time
    if last[0] == milliseconds:
        return last[1]
    try:
        made = datetime.fromtimestamp(milliseconds / 1000, UTC)
    except (OverflowError, OSError, ValueError):
        return None
    _last_time = (milliseconds, made)
    return made


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) else None


def _header_id(raw_id: bytes | None, config: KafkaConfig) -> tuple[str | None, str | None]:
    """The id header's text (passed on as found: an empty or too long id fails the core's
    validation), or why it is refused; (None, None) when there is no id header."""
    if raw_id is None:
        return None, None
    try:
        return raw_id.decode("utf-8"), None
    except UnicodeDecodeError:
        return None, f"the {config.id_header!r} header is not valid UTF-8: {raw_id[:64]!r}"


def _with_key(message: Message, record: Any, config: KafkaConfig) -> tuple[Message, str | None]:
    """No id header: the key function's id, else the coordinates, else the refusal."""
    missing = f"no message id: no {config.id_header!r} header"
    if config.key is not None:
        try:
            found = config.key(message)
        except Exception as exc:  # a key function that cannot read this record: refuse it
            return message, f"{missing}, and the key function raised {describe(exc)}"
        if found is not None:
            return replace(message, id=found), None
        missing += ", and the key function found none"
    if config.coordinates_as_id:
        return replace(message, id=coordinates_id(record)), None
    return message, missing


def dead_letter_headers(record: Any, reason: str, consumer: str) -> list[tuple[str, bytes]]:
    """The original headers (any earlier dead-letter ones replaced) plus why and from where."""
    kept = [
        (name, value or b"")
        for name, value in _header_pairs(record)
        if name not in OUR_HEADERS and isinstance(name, str) and isinstance(value, bytes | None)
    ]
    return [
        *kept,
        (REASON_HEADER, reason[:REASON_LIMIT].encode()),
        (CONSUMER_HEADER, consumer.encode()),
        (SOURCE_HEADER, str(record.topic).encode()),
        (PARTITION_HEADER, str(record.partition).encode()),
        (OFFSET_HEADER, str(record.offset).encode()),
    ]


def _header_pairs(record: Any) -> list[Any]:
    """``record.headers`` as pairs; none at all if they cannot be read as such."""
    try:
        return [pair for pair in record.headers if isinstance(pair, tuple) and len(pair) == 2]
    except TypeError:
        return []
