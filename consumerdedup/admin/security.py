"""Who may look and who may act: deny by default.

Every request is judged before its page runs:

- ``token`` (the standalone server's, required off loopback): the request carries it as
  ``Authorization: Bearer TOKEN`` or as the session cookie the login form sets (a digest
  of the token, never the token itself); anything else is 401.
- ``authorize(request)``: the application's own auth decides, returning a ``Role`` (or a
  ``Grant`` naming who) or None (403). Without it the app is refused at construction,
  unless ``allow_loopback=True`` says on purpose that any client on this host may act
  (behind a reverse proxy on the same host every client looks local: use ``authorize``).
- Actions exist only when ``actions=True`` and for the OPERATOR role; every action is a
  POST with the CSRF token of the double-submit cookie (a form field or the
  ``X-CSRF-Token`` header, compared in constant time), and a cross-site ``Origin`` is
  refused. A GET never changes anything.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import ipaddress
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.requests import Request

CSRF_COOKIE = "consumerdedup_admin_csrf"
SESSION_COOKIE = "consumerdedup_admin_session"
CSRF_FIELD = "csrf"
CSRF_HEADER = "x-csrf-token"


class Role(StrEnum):
    """VIEWER reads every page; OPERATOR may also act, when actions are enabled."""

    VIEWER = "viewer"
    OPERATOR = "operator"


@dataclass(frozen=True, slots=True)
class Grant:
    """What ``authorize`` may return to name who is acting (written to the audit trail)."""

    role: Role
    who: str


Authorize = Callable[[Request], "Role | Grant | Awaitable[Role | Grant | None] | None"]


@dataclass(frozen=True, slots=True)
class Visitor:
    """The judged request: its role, its name for the audit, whether it may act."""

    role: Role
    who: str
    can_act: bool
    csrf: str
    new_csrf: bool


def session_value(token: str) -> str:
    """The login cookie's value: a digest of the token, so the cookie is not the token."""
    return hmac.new(token.encode(), b"consumerdedup-admin-session", hashlib.sha256).hexdigest()


def is_loopback(host: str | None) -> bool:
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Access:
    """The app's security settings (checked by ``admin_app``)."""

    authorize: Authorize | None
    allow_loopback: bool
    token: str | None
    actions: bool

    def token_given(self, request: Request) -> bool:
        if self.token is None:
            return True
        given = request.headers.get("authorization", "")
        if given.lower().startswith("bearer "):
            return hmac.compare_digest(given[7:].strip().encode(), self.token.encode())
        cookie = request.cookies.get(SESSION_COOKIE, "")
        return hmac.compare_digest(cookie.encode(), session_value(self.token).encode())

    async def visitor(self, request: Request) -> Visitor:
        """The request's Visitor; HTTPException 401 or 403 if it may not see anything."""
        if not self.token_given(request):
            raise HTTPException(401, "a token is required: log in, or send Authorization: Bearer")
        client = request.client.host if request.client else None
        grant: Any
        if self.authorize is not None:
            grant = self.authorize(request)
            if inspect.isawaitable(grant):
                grant = await grant
        elif self.allow_loopback and is_loopback(client):
            grant = Role.OPERATOR
        elif self.token is not None:
            grant = Grant(Role.OPERATOR, "token holder")
        else:
            grant = None
        if grant is None:
            raise HTTPException(403, "not allowed to see the admin pages")
        if isinstance(grant, Role):
            grant = Grant(grant, client or "unknown client")
        if not isinstance(grant, Grant) or not isinstance(grant.role, Role):
            raise HTTPException(403, "authorize returned neither a Role, a Grant nor None")
        csrf = request.cookies.get(CSRF_COOKIE, "")
        new = len(csrf) < 32
        if new:
            csrf = secrets.token_urlsafe(32)
        can_act = self.actions and grant.role is Role.OPERATOR
        return Visitor(grant.role, grant.who, can_act, csrf, new)

    async def actor(self, request: Request) -> tuple[Visitor, FormData]:
        """The Visitor of a POST that changes something, and its form; 403 unless it may act
        and its CSRF token matches."""
        visitor = await self.visitor(request)
        form = await request.form() if _is_form(request) else FormData()
        check_csrf(request, visitor, form)
        if not visitor.can_act:
            why = "actions are not enabled" if not self.actions else "only an operator may act"
            raise HTTPException(403, f"read-only: {why}")
        return visitor, form


def check_csrf(request: Request, visitor: Visitor, form: FormData) -> None:
    """403 unless the POST carries the cookie's CSRF token and comes from this site."""
    origin = request.headers.get("origin")
    if origin and origin != "null" and urlsplit(origin).netloc != request.headers.get("host"):
        raise HTTPException(403, "cross-site request refused (Origin is another site)")
    sent = str(form.get(CSRF_FIELD) or request.headers.get(CSRF_HEADER) or "")
    if visitor.new_csrf or not sent or not hmac.compare_digest(sent, visitor.csrf):
        raise HTTPException(403, "CSRF token missing or wrong: reload the page and try again")


def _is_form(request: Request) -> bool:
    kind = request.headers.get("content-type", "")
    return kind.startswith(("application/x-www-form-urlencoded", "multipart/form-data"))
