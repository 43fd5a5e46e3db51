"""What pika cannot decode, read so the delivery still comes through (the Kafka twin: undecodable).

pika decodes a frame's header table while it reads from the socket; a value it cannot turn
into a Python object raises there, inside the connection, which is lost, and the message comes
again at every reconnect. Importing this module (connection.py does) installs a field decoder
that keeps such a value as it was sent, so the delivery reaches the runner, which converts it
(or refuses it with the reason) like any other.
"""

from __future__ import annotations

import struct
from datetime import UTC, datetime
from typing import Any

import pika.data  # type: ignore[import-untyped]


def _decode_value(encoded: bytes, offset: int) -> tuple[Any, int]:
    """pika's field decoder, except that a timestamp Python cannot hold stays the int sent.

    pika turns an AMQP timestamp field ('T', any uint64) into a datetime while it reads
    the frame: past year 9999 that raises inside the connection, which is then lost, and
    the message comes again at every reconnect: one header would stop the queue for good.
    """
    if encoded[offset : offset + 1] == b"T":
        seconds = struct.unpack_from(">Q", encoded, offset + 1)[0]
        try:
            return datetime.fromtimestamp(seconds, UTC), offset + 9
        except (OverflowError, OSError, ValueError):
            return seconds, offset + 9
    decoded: tuple[Any, int] = _pika_decode_value(encoded, offset)
    return decoded


# pika's tables look the decoder up by name at each field (nested ones too), so this
# changes nothing but the case that raised.
_pika_decode_value = getattr(pika.data.decode_value, "pika_original", pika.data.decode_value)
_decode_value.pika_original = _pika_decode_value  # type: ignore[attr-defined]
pika.data.decode_value = _decode_value
