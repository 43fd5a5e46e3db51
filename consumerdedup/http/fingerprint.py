"""What makes two requests with one key "the same request": a sha256 the store keeps.

By default: method, path, query string and body, each length-prefixed so that
no two different requests hash alike by moving bytes between the parts. A
client that re-serialises its JSON (key order, spacing) can be matched with
``json_fields("amount", "currency")`` instead, or any callable of RequestFacts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigurationError
from ..options import text


@dataclass(frozen=True)
class RequestFacts:
    """What a fingerprint may look at; headers as (lowercase name, value) pairs, in order."""

    method: str
    path: str
    query: bytes
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()


Fingerprinter = Callable[[RequestFacts], str]


def _digest(*parts: bytes) -> str:
    sha = hashlib.sha256()
    for part in parts:
        sha.update(len(part).to_bytes(8, "big"))
        sha.update(part)
    return sha.hexdigest()


def default_fingerprint(request: RequestFacts) -> str:
    """sha256 over method, path, query and body."""
    return _digest(
        request.method.upper().encode("ascii"),
        request.path.encode("utf-8", "surrogateescape"),
        request.query,
        request.body,
    )


def json_fields(*names: str) -> Fingerprinter:
    """sha256 over method, path and the named top-level fields of a JSON body.

    A body that is not a JSON object fingerprints as its raw bytes, so two
    unreadable bodies are still told apart.
    """
    if not names:
        raise ConfigurationError("json_fields(*names): give one or more field names")
    for index, name in enumerate(names):
        text(name, f"json_fields(names[{index}])")

    def fingerprint(request: RequestFacts) -> str:
        try:
            document: Any = json.loads(request.body)
        except ValueError:
            document = None
        if not isinstance(document, dict):
            return default_fingerprint(request)
        chosen = {n: document.get(n) for n in names}
        canonical = json.dumps(chosen, sort_keys=True, separators=(",", ":")).encode()
        return _digest(request.method.upper().encode("ascii"), request.path.encode(), canonical)

    return fingerprint
