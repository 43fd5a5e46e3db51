"""The Idempotency-Key header: parsed strictly, refused with a reason the client can act on.

Two forms are accepted. The IETF draft's (``Idempotency-Key: "8e03978e"``) is
a Structured Field String (RFC 8941 section 3.3.3): printable ASCII in double
quotes, where ``\\"`` and ``\\\\`` are the only escapes. Stripe's is the bare
value (``Idempotency-Key: 8e03978e``): visible ASCII without spaces, quotes,
backslashes or commas (a comma is what a proxy puts between two header lines
it merged). Either way the key is 1 to 255 characters; anything else, and a
request that carries the header twice, is refused (400) rather than guessed at.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from ..errors import ConsumerDedupError

HEADER = "idempotency-key"
MAX_KEY_LENGTH = 255
_MAX_RAW = 2 * MAX_KEY_LENGTH + 2  # every character escaped, plus the quotes
_OWS = " \t"
_BARE_REFUSED = frozenset('"\\,')


class InvalidIdempotencyKey(ConsumerDedupError, ValueError):
    """The request's Idempotency-Key header is malformed: answered with 400, nothing runs."""


def parse_key(values: Iterable[bytes | str]) -> str | None:
    """The key carried by a request's Idempotency-Key header lines; None when there is none.

    ``values`` are the raw values of every header line of that name, in order.
    """
    lines = list(values)
    if not lines:
        return None
    if len(lines) > 1:
        raise InvalidIdempotencyKey(
            "the request carries more than one Idempotency-Key header; send exactly one"
        )
    raw = lines[0]
    if isinstance(raw, bytes):
        raw = raw.decode("latin-1")  # HTTP field values are bytes; non-ASCII is refused below
    text = raw.strip(_OWS)
    if len(text) > _MAX_RAW:
        raise InvalidIdempotencyKey(_too_long())
    key = _quoted(text) if text.startswith('"') else _bare(text)
    if not key:
        raise InvalidIdempotencyKey(
            "the Idempotency-Key header is empty; send 1 to 255 printable ASCII characters, "
            "e.g. a UUID"
        )
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidIdempotencyKey(_too_long())
    return key


def _quoted(text: str) -> str:
    """RFC 8941 sf-string: DQUOTE *( unescaped / escaped ) DQUOTE, and nothing after it."""
    out: list[str] = []
    i = 1
    while i < len(text):
        char = text[i]
        if char == "\\":
            if i + 1 >= len(text) or text[i + 1] not in '"\\':
                raise InvalidIdempotencyKey(
                    'the quoted Idempotency-Key has a backslash not followed by " or \\; '
                    'send a quote as \\" and a backslash as \\\\ (RFC 8941), or the key bare'
                )
            out.append(text[i + 1])
            i += 2
            continue
        if char == '"':
            if i != len(text) - 1:
                raise InvalidIdempotencyKey(
                    "the Idempotency-Key has characters after its closing quote; "
                    "send one quoted string and nothing else"
                )
            return "".join(out)
        _check_printable(char)
        out.append(char)
        i += 1
    raise InvalidIdempotencyKey(
        'the quoted Idempotency-Key has no closing quote; send it as "key" or as a bare key'
    )


def _bare(text: str) -> str:
    for char in text:
        _check_printable(char)
        if char == " " or char in _BARE_REFUSED:
            raise InvalidIdempotencyKey(
                "a bare Idempotency-Key cannot hold spaces, quotes, backslashes or commas; "
                'send such a key as a quoted string ("...", RFC 8941)'
            )
    return text


def _check_printable(char: str) -> None:
    if not " " <= char <= "~":
        raise InvalidIdempotencyKey(
            "the Idempotency-Key holds a character that is not printable ASCII "
            f"(code {ord(char)}); send 1 to 255 printable ASCII characters, e.g. a UUID"
        )


def _too_long() -> str:
    return f"the Idempotency-Key is longer than {MAX_KEY_LENGTH} characters; send a shorter key"


def key_label(key: str) -> str:
    """How a key appears in log lines: a digest, never the key (it may be guessable or secret)."""
    return "key#" + hashlib.sha256(key.encode("ascii")).hexdigest()[:12]
