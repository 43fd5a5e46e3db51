"""``/login``: where a browser gives the token once (a form, POSTed with its CSRF token);
the answer is a session cookie holding a digest of the token (HttpOnly, SameSite=Strict),
so later pages need no header. Scripts send ``Authorization: Bearer TOKEN`` instead."""

from __future__ import annotations

import hmac
import secrets

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from .render import base, page
from .security import CSRF_COOKIE, SESSION_COOKIE, Role, Visitor, check_csrf, session_value

SESSION_SECONDS = 8 * 3600


def routes() -> list[Route]:
    return [Route("/login", login, methods=["GET", "POST"])]


async def login(request: Request) -> Response:
    access = request.app.state.access
    if access.token is None:
        raise HTTPException(404, "no token is set: there is nothing to log in to")
    csrf = request.cookies.get(CSRF_COOKIE, "")
    fresh = len(csrf) < 32
    anonymous = Visitor(Role.VIEWER, "", False, secrets.token_urlsafe(32) if fresh else csrf, fresh)
    if request.method == "GET":
        return page(request, anonymous, "login.html", {"refused": False}, title="Log in")
    form = await request.form()
    check_csrf(request, anonymous, form)
    given = str(form.get("token") or "").strip()
    if not hmac.compare_digest(given.encode(), access.token.encode()):
        return page(request, anonymous, "login.html", {"refused": True}, status=401, title="Log in")
    response = RedirectResponse(base(request) + "/overview", status_code=303)
    response.set_cookie(
        SESSION_COOKIE,
        session_value(access.token),
        max_age=SESSION_SECONDS,
        path=base(request) + "/",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response
