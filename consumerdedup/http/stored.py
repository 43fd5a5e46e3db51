"""A response as kept for replay: status, the headers safe to send again, the whole body.

Never kept: ``Set-Cookie`` (a session must not be handed to whoever retries),
``Date`` and ``Server`` (the replaying server sets its own), hop-by-hop and
per-connection headers (RFC 9110 section 7.6.1, and any the Connection header
names), and ``Idempotent-Replayed`` (added on replay only).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import ConsumerDedupError

REPLAYED_HEADER = ("idempotent-replayed", "true")
_NEVER_REPLAYED = frozenset(
    {
        "set-cookie",
        "date",
        "server",
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "idempotent-replayed",
    }
)
_FORMAT = 1
# What a server can send again (RFC 9110 5.1, 5.5): a token name, a value without CR, LF, NUL
# or other controls but HTAB. Anything else makes every replay drop the connection.
_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")


class CorruptStoredResponse(ConsumerDedupError):
    """A stored response could not be read back (a foreign or damaged record)."""


@dataclass(frozen=True)
class StoredResponse:
    """A response; ``replayable=False`` records one that ran but could not be kept (no body)."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    replayable: bool = True
    why_not: str = ""
    """When not replayable at capture: why (for the log line)."""

    @classmethod
    def capture(
        cls, status: int, headers: Iterable[tuple[bytes | str, bytes | str]], body: bytes
    ) -> StoredResponse:
        """From what an app sent: header names lowercased, unsafe headers dropped."""
        pairs = [(_text(n).lower(), _text(v)) for n, v in headers]
        per_connection = {
            token.strip().lower()
            for name, value in pairs
            if name == "connection"
            for token in value.split(",")
        }
        kept = tuple(
            (n, v) for n, v in pairs if n not in _NEVER_REPLAYED and n not in per_connection
        )
        for name, value in kept:
            if not _NAME.fullmatch(name) or not _VALUE.fullmatch(value):
                # Stored, it would break every replay (the server refuses to send it): record
                # it as ran-but-not-stored, so a retry is refused, never run again.
                return cls.unreplayable(status, "a header no server can send again")
        return cls(status, kept, body)

    @classmethod
    def unreplayable(cls, status: int, why_not: str = "") -> StoredResponse:
        return cls(status, (), b"", replayable=False, why_not=why_not)

    def replay_headers(self) -> list[tuple[bytes, bytes]]:
        """The stored headers and ``Idempotent-Replayed: true``, as ASGI wants them."""
        pairs = [*self.headers, REPLAYED_HEADER]
        return [(n.encode("latin-1"), v.encode("latin-1")) for n, v in pairs]

    def meta_json(self) -> str:
        """Status and headers (and the format version): everything but the body."""
        return json.dumps(
            {
                "v": _FORMAT,
                "status": self.status,
                "headers": self.headers,
                "replay": self.replayable,
            }
        )

    @classmethod
    def from_meta_json(cls, meta: str | bytes, body: bytes) -> StoredResponse:
        try:
            document = json.loads(meta)
            if document["v"] != _FORMAT:
                raise ValueError(f"format {document['v']!r}")
            headers = tuple((str(n), str(v)) for n, v in document["headers"])
            return cls(int(document["status"]), headers, bytes(body), bool(document["replay"]))
        except (ValueError, KeyError, TypeError) as error:
            raise CorruptStoredResponse(f"stored response unreadable: {error}") from None

    def to_bytes(self) -> bytes:
        """One blob (for key-value stores): the metadata line, a newline, the body."""
        return self.meta_json().encode() + b"\n" + self.body

    @classmethod
    def from_bytes(cls, blob: bytes) -> StoredResponse:
        meta, newline, body = blob.partition(b"\n")
        if not newline:
            raise CorruptStoredResponse("stored response unreadable: no metadata line")
        return cls.from_meta_json(meta, body)


def _text(value: bytes | str) -> str:
    return value.decode("latin-1") if isinstance(value, bytes) else value
