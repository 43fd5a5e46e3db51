"""What every action's second POST must carry: ``confirm=yes``, a reason, and for an
action on a whole search the count its preview showed."""

from __future__ import annotations

from typing import Any

from starlette.exceptions import HTTPException


def reason_of(form: Any) -> str:
    """The operator's reason (the ``why`` field); 400 without it or without confirm=yes."""
    reason = str(form.get("why") or "").strip()
    if form.get("confirm") != "yes" or not reason:
        raise HTTPException(400, "an action needs confirm=yes and a reason (why)")
    return reason


def check_confirmed(form: Any, found: int) -> None:
    """409 if a whole-query action now takes more than the preview counted and the
    operator confirmed: records that failed since are not acted on unseen."""
    confirmed = str(form.get("expected") or "")
    if not confirmed.isdigit():
        raise HTTPException(400, "an action on a whole search needs the count it was shown")
    if found > int(confirmed):
        raise HTTPException(
            409,
            f"the search now matches {found} records, not the {confirmed} you confirmed: "
            "preview it again",
        )
