"""Whether a bind address is reached only from this machine. The admin pages decide on it
(``consumerdedup admin`` and ``app.admin``): off loopback every request needs the token.
Kept apart from both so that neither the CLI nor the App's extra is needed by the other.
(A request's client address is judged by consumerdedup.admin.security, which takes an IP
only: a client never calls itself ``localhost``.)"""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback IP (127.0.0.0/8, ::1); a name that is not an IP: no."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
