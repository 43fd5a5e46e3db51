"""Route patterns: which request paths a route policy covers, checked to be able to match.

A pattern is matched against the request's path as the server hands it over: ASGI's
``scope["path"]`` and WSGI's ``SCRIPT_NAME + PATH_INFO``, both percent-decoded, without
the query string (which the client sends apart) and without the fragment (which it never
sends). A pattern that could match no such path is a route the user asked to protect
that would silently not be, even with ``required=True``: it is refused at construction,
with the reason.
"""

from __future__ import annotations

import re
import unicodedata

from ..errors import ConfigurationError

_PARAMETER = re.compile(r"(\{[^{}]*\})")
_PERCENT = re.compile(r"%[0-9A-Fa-f]{2}")


def _reason(pattern: str) -> str | None:
    """Why ``pattern`` can never match a request path, or None when it can."""
    if not pattern.startswith("/"):
        return "must start with / (a path, as the request's path starts; no scheme or host)"
    if any(c.isspace() for c in pattern):
        return (
            "holds whitespace, which no request path has unless percent-encoded "
            "(a trailing space is a typo; use {name} or a trailing * for such a segment)"
        )
    if any(unicodedata.category(c).startswith("C") for c in pattern):
        return "holds a control character (or an invisible format character)"
    if "?" in pattern:
        return (
            "holds a query string: a pattern matches the path only (the query is not part "
            "of it; a route covers every query of its path)"
        )
    if "#" in pattern:
        return "holds a fragment (#...), which a client never sends"
    if _PERCENT.search(pattern):
        return (
            "holds a percent-escape: the path is matched percent-decoded, so write the "
            "character itself"
        )
    if "*" in pattern[:-1]:
        return "has a * that is not at the end: only a trailing * is a wildcard (use {name})"
    return None


class RoutePattern:
    """``/orders/{id}/pay``: one segment per ``{name}`` or ``{name:conv}`` (``{name:path}``:
    one or more segments, as Starlette's), and a trailing ``*`` for anything after."""

    def __init__(self, pattern: str) -> None:
        if not isinstance(pattern, str):
            raise ConfigurationError(
                f"route pattern {pattern!r} ({type(pattern).__name__}): expected a str path "
                "such as '/payments' or '/orders/{id}/pay'"
            )
        reason = _reason(pattern)
        if reason is not None:
            raise ConfigurationError(f"route pattern {pattern!r} can never match: it {reason}")
        self.pattern = pattern
        wild = pattern.endswith("*")
        body = pattern[:-1] if wild else pattern
        regex = ""
        for part in _PARAMETER.split(body):
            if part.startswith("{"):
                regex += ".+" if part.rstrip("}").endswith(":path") else "[^/]+"
            elif "{" in part or "}" in part:
                raise ConfigurationError(
                    f"route pattern {pattern!r} can never match: it has an unbalanced brace"
                )
            else:
                regex += re.escape(part)
        self._regex = re.compile(regex + (".*" if wild else ""))

    def matches(self, path: str) -> bool:
        return self._regex.fullmatch(path) is not None

    def __repr__(self) -> str:
        return f"RoutePattern({self.pattern!r})"


__all__ = ["RoutePattern"]
