"""The rows a form chose: each posted as the JSON pair of strings the page wrote for it
(``["payments", "m-1"]``: a consumer and a message id, a scope and a key). Anything else
is a 400, so a forged value is refused before it reaches a statement."""

from __future__ import annotations

import json
from typing import Any

from starlette.exceptions import HTTPException


def pairs_of(form: Any, field: str, what: str) -> list[tuple[str, str]]:
    """The pairs posted as ``field``, each once, in the order posted; ``what`` names one
    in the 400 (``record's key``)."""
    chosen: list[tuple[str, str]] = []
    for raw in form.getlist(field):
        try:
            first, second = json.loads(str(raw))
        except (ValueError, TypeError):
            raise HTTPException(400, f"a chosen {what} is not one of ours") from None
        if not isinstance(first, str) or not isinstance(second, str):
            raise HTTPException(400, f"a chosen {what} is not one of ours")
        chosen.append((first, second))
    return list(dict.fromkeys(chosen))
