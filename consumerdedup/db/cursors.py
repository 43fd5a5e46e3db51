"""Keyset cursors for pages of rows (FAILED records, parked outbox events): made and read in
this one place.

A cursor is opaque to its reader: base64url (unpadded) of a JSON array, a tag naming the
list it belongs to, then the last row's key. Anyone can forge one, so reading it checks
each part of the key against what its column can hold before any statement sees it (text
no longer than the column, with no NUL and no lone surrogate, which no driver sends; an
integer in bigint's range): a forged cursor is an ``InvalidCursor``, never a
driver's error.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import TypeGuard

from ..errors import ConfigurationError

BIGINT = (-(2**63), 2**63 - 1)
CHARACTERS_PER_KEY_CHARACTER = 40
"""A cursor's length bound, per character of the longest key text: JSON writes a character
as up to 12 (an astral one as two escapes), a cursor holds up to two such texts, base64
makes 4 of 3 (2 x 12 x 4/3 = 32), and the tag and brackets fit in the rest."""

Key = tuple[str | int, ...]


class InvalidCursor(ConfigurationError):
    """A cursor that is not one an earlier page of the same list gave."""


def encode(tag: str, *key: str | int) -> str:
    """The cursor of the row whose key is ``key``, in the list named ``tag``."""
    raw = json.dumps([tag, *key], separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode(
    cursor: object, tag: str, kinds: tuple[type[str] | type[int], ...], *, longest: int
) -> Key:
    """The key ``cursor`` stands for, each part of the kind ``kinds`` names (str or int) and
    one its column can hold (text: 1 to ``longest`` characters); InvalidCursor if it is
    anything else."""
    parts = _parts(cursor, CHARACTERS_PER_KEY_CHARACTER * longest)
    if parts is None or len(parts) != len(kinds) + 1 or parts[0] != tag:
        raise InvalidCursor(
            f"invalid cursor: not one from an earlier page of the {tag} list (--after)"
        )
    key: list[str | int] = []
    for kind, value in zip(kinds, parts[1:], strict=True):
        if _holds(value, kind, longest):
            key.append(value)
    if len(key) != len(kinds):
        raise InvalidCursor(
            f"invalid cursor: its key is not one a row of the {tag} list can have (--after)"
        )
    return tuple(key)


def _parts(cursor: object, most: int) -> list[object] | None:
    if not isinstance(cursor, str) or not cursor or len(cursor) > most:
        return None
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        parts = json.loads(raw)
    except (binascii.Error, ValueError, RecursionError):  # UnicodeDecodeError too
        return None
    return parts if isinstance(parts, list) else None


def _holds(value: object, kind: type[str] | type[int], longest: int) -> TypeGuard[str | int]:
    if kind is int:
        return type(value) is int and BIGINT[0] <= value <= BIGINT[1]
    if not isinstance(value, str) or not 0 < len(value) <= longest or "\x00" in value:
        return False
    try:
        value.encode()  # a lone surrogate (JSON's "\ud800") is no text a driver can send
    except UnicodeEncodeError:
        return False
    return True
