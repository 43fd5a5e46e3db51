"""Durations as people type them: ``90s``, ``15m``, ``36h``, ``7d``, ``2w``, ``1d12h``, ``250ms``.

``parse`` refuses anything that is not a positive, finite duration, with a
message that says what was wrong; ``render`` writes a timedelta back in the
same notation. Units are lowercase only: ``M`` means months to many people
(and in RabbitMQ's ``x-max-age``), so ``7M`` is refused rather than read as
7 minutes, and so are ``7D`` or ``7H``, which nothing documents.
"""

from __future__ import annotations

import re
from datetime import timedelta

from .errors import ConfigurationError

_UNITS = {"w": 604800.0, "d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
_PART = re.compile(r"(\d+)(ms|[wdhms])")
_WHOLE = re.compile(r"(?:\d+(?:ms|[wdhms]))+")
FOREVER = frozenset({"forever", "never", "infinite", "infinity", "inf", "unlimited", "-1"})
"""Words for "no limit", which ``parse`` refuses with a message of its own."""
EXAMPLES = "e.g. 90s, 15m, 36h, 7d, 2w or 1d12h"
UNITS = "ms, s, m (minutes), h, d, w"


def parse(text: str, what: str = "duration") -> timedelta:
    """``"36h"`` -> ``timedelta(hours=36)``; a ConfigurationError naming ``what`` otherwise."""
    raw = text.strip().replace(" ", "")
    if raw.lower() in FOREVER:
        raise ConfigurationError(f"{what} {text!r}: it must be a finite duration ({EXAMPLES})")
    if raw.startswith("-"):
        raise ConfigurationError(f"{what} {text!r} is negative: it must be a positive duration")
    if not _WHOLE.fullmatch(raw):
        if _WHOLE.fullmatch(raw.lower()):
            raise ConfigurationError(
                f"{what} {text!r}: units are lowercase ({UNITS}); "
                "an uppercase M could mean minutes or months"
            )
        raise ConfigurationError(f"{what} {text!r} is not a duration ({EXAMPLES})")
    millis = sum(int(n) * round(_UNITS[unit] * 1000) for n, unit in _PART.findall(raw))
    if millis == 0:
        raise ConfigurationError(f"{what} {text!r} is zero: it must be a positive duration")
    try:
        return timedelta(milliseconds=millis)
    except OverflowError:
        raise ConfigurationError(f"{what} {text!r} is too long") from None


def render(value: timedelta) -> str:
    """``timedelta(days=1, hours=12)`` -> ``"1d12h"``; below a second, milliseconds."""
    if value < timedelta(0):
        return "-" + render(-value)
    total = int(value.total_seconds())
    parts: list[str] = []
    for unit in "dhms":
        count, total = divmod(total, int(_UNITS[unit]))
        if count:
            parts.append(f"{count}{unit}")
    if value.microseconds >= 1000 or not parts:
        parts.append(f"{value.microseconds // 1000}ms")
    return "".join(parts)
