"""Passwords out of the command's output: hidden where they stand, never searched for as text.

Replacing every occurrence of a password's text garbles the output (a password
``e`` turned ``postgresql`` into ``postgr***sql``) and still misses its other
spellings (percent-encoded in a URL). So a password is masked in its place: in
a URL's ``user:password@``, in a ``password=`` parameter (a URL's query or a
driver's key=value connection string), and wherever a URL given on the command
line is quoted whole (then it is shown as masked).
"""

from __future__ import annotations

import re

from sqlalchemy.engine import URL

MASK = "***"
_USERINFO = re.compile(r"(://[^:/@\s]*:)[^\s/]*@")  # ://user:password@ (up to the last @)
_PARAMETER = re.compile(r"""(?i)(\b\w*pass\w*\s*=\s*)('[^']*'|"[^"]*"|[^\s&'",;)]+)""")


def mask(text: str) -> str:
    """``text`` with the password of every URL and ``password=`` parameter in it masked."""
    return _PARAMETER.sub(rf"\1{MASK}", _USERINFO.sub(rf"\1{MASK}@", text))


def shown(url: URL) -> str:
    """A database URL as it may be printed."""
    return mask(url.render_as_string(hide_password=True))


class Secrets:
    """The URLs a command was given, so that its output and logs show them only masked."""

    def __init__(self) -> None:
        self._quoted: dict[str, str] = {}  # a URL as it may appear -> as it is shown

    def add_url(self, given: str, url: URL | None = None) -> None:
        """A URL from the command line; ``url``: what SQLAlchemy parsed it into, if it did."""
        masked = shown(url) if url is not None else mask(given)
        forms = [given]
        if url is not None:  # drivers quote the URL the way SQLAlchemy renders it
            forms.append(url.render_as_string(hide_password=False))
        for form in forms:
            if form != masked:
                self._quoted[form] = masked

    def scrub(self, text: str) -> str:
        """``text`` with every URL we were given masked, and any other password in place."""
        for given in sorted(self._quoted, key=len, reverse=True):
            text = text.replace(given, self._quoted[given])
        return mask(text)
