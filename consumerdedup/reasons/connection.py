"""libpq's words for a connection that failed, as a reason: for each address it tried,
the host and port kept, why masked, and the fix."""

from __future__ import annotations

import re

from .fixes import connection_fix
from .masking import MASK, NUMBER, masked

_SERVER = re.compile(
    r'connection to server (?:at "(?P<host>[^"]*)", port (?P<port>\d+)'
    r'|on socket "(?P<socket>[^"]*)") failed: '
)
"""libpq's words for each address it tried; what follows up to the next is why."""
_RESOLVE = re.compile(r"failed to resolve host '(?P<host>[^']*)': (?P<why>[^\n]*)\Z")


def is_connection_failure(raw: str) -> bool:
    """``raw`` is libpq's account of a failed connection (or of a host not resolved)."""
    return bool(_SERVER.search(raw) or _RESOLVE.search(raw))


def connection_text(raw: str) -> str:
    """libpq's "connection to server at "host", port N failed: why" for each address tried:
    the host and port kept, each why masked as a message and followed by its fix."""
    if resolve := _RESOLVE.search(raw):
        host = resolve["host"]
        return (
            f"cannot resolve the host {host!r} ({NUMBER.sub(MASK, resolve['why'])}): "
            "check the host in the database URL"
        )
    prefix = raw[: _SERVER.search(raw).start()]  # type: ignore[union-attr]
    matches = list(_SERVER.finditer(raw))
    parts = []
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(raw)
        why = raw[match.end() : end].split("\n\t")[0].strip()  # the libpq hint: our fix says it
        why = why.removeprefix("FATAL:").strip()
        where = (
            f"socket {match['socket']}" if match["socket"] else f"{match['host']}:{match['port']}"
        )
        said = masked(why)
        fix = connection_fix(said, where)
        parts.append(f"{match.group(0)}{said}" + (f": {fix}" if fix else ""))
    return (prefix if prefix.strip() else "") + " ".join(parts)
