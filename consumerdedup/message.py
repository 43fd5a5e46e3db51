"""The broker-neutral message every adapter builds from a delivery."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType
from typing import Any

from .errors import DecodeError, InvalidMessage

MAX_ID_LENGTH = 255
"""Longest accepted message id: it is half of the processed_events primary key."""


@dataclass(frozen=True, slots=True)
class Message:
    """One delivery, as the pipeline sees it.

    ``id`` is the dedup key: the producer's stable event id, never the broker's
    delivery tag. ``raw`` keeps the broker's own object for adapters and
    handlers that need it; it takes no part in equality.
    """

    id: Any
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)
    source: str = ""
    partition: int | None = None
    offset: int | None = None
    timestamp: datetime | None = None
    raw: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Headers are frozen too, so a handler cannot change what was hashed or logged.
        if not isinstance(self.headers, MappingProxyType):
            object.__setattr__(self, "headers", MappingProxyType(dict(self.headers)))

    def text(self, encoding: str = "utf-8") -> str:
        """The body as text; a body that is not valid ``encoding`` is a DecodeError."""
        try:
            return self.body.decode(encoding)
        except (UnicodeDecodeError, AttributeError) as exc:
            raise DecodeError(f"body is not valid {encoding}: {exc}") from exc

    def json(self) -> Any:
        """The body parsed as JSON; anything else is a DecodeError (permanent)."""
        try:
            return json.loads(self.text())
        except json.JSONDecodeError as exc:
            raise DecodeError(f"body is not valid JSON: {exc}") from exc


def validate_id(message_id: object) -> str:
    """Return the id if it can be a dedup key, else raise InvalidMessage."""
    if not isinstance(message_id, str):
        raise InvalidMessage(f"message id must be a str, got {type(message_id).__name__}")
    if not message_id:
        raise InvalidMessage("message id is empty")
    if len(message_id) > MAX_ID_LENGTH:
        raise InvalidMessage(
            f"message id is {len(message_id)} characters long, the limit is {MAX_ID_LENGTH}"
        )
    # Refused here, or every statement carrying the key fails in the driver instead.
    if "\x00" in message_id:
        raise InvalidMessage(
            f"message id {_shown(message_id)} contains NUL, which no database stores"
        )
    try:
        message_id.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidMessage(
            f"message id {_shown(message_id)} is not valid Unicode (a lone surrogate)"
        ) from None
    return message_id


def _shown(message_id: str) -> str:
    return ascii(message_id[:64])


def payload_hash(body: object) -> str:
    """sha256 of the body, hex: what tells a redelivery from a reused id."""
    if isinstance(body, str):
        body = body.encode()
    if not isinstance(body, bytes | bytearray | memoryview):
        raise InvalidMessage(f"message body must be bytes, got {type(body).__name__}")
    return hashlib.sha256(body).hexdigest()
