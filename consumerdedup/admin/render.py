"""One route, two forms: HTML for a person (server-rendered, readable without JavaScript)
and JSON for a script (``Accept: application/json`` or the route's ``.json`` twin)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from .security import CSRF_COOKIE, Visitor

templates = Environment(
    loader=PackageLoader("consumerdedup.admin", "templates"),
    autoescape=select_autoescape(default=True, default_for_string=True),
    trim_blocks=True,
    lstrip_blocks=True,
)


def wants_json(request: Request) -> bool:
    if request.url.path.endswith(".json"):
        return True
    accept = request.headers.get("accept", "")
    return "application/json" in accept and "text/html" not in accept


def base(request: Request) -> str:
    """Where the admin app is mounted (``/admin``), for its links."""
    return str(request.scope.get("root_path", "")).rstrip("/")


def plain(value: Any) -> Any:
    """``value`` as JSON has it: datetimes in ISO 8601, tuples as lists."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def page(
    request: Request,
    visitor: Visitor | None,
    template: str,
    data: Mapping[str, Any],
    *,
    status: int = 200,
    title: str = "",
) -> Response:
    """``data`` as JSON or through ``template``; the CSRF cookie set on a first visit."""
    response: Response
    if wants_json(request):
        body = dict(plain(data))
        if visitor is not None:
            body["csrf"] = visitor.csrf
            body["role"] = visitor.role.value
            body["can_act"] = visitor.can_act
        response = JSONResponse(body, status_code=status)
    else:
        html = templates.get_template(template).render(
            **data,
            visitor=visitor,
            base=base(request),
            title=title,
            app_title=request.app.state.title,
            has_audit=getattr(request.app.state, "audit_table", None) is not None,
            path=request.url.path,
            tojson=lambda v: json.dumps(v),
        )
        response = HTMLResponse(html, status_code=status)
    response.headers["cache-control"] = "no-store"
    response.headers["x-frame-options"] = "DENY"
    response.headers["content-security-policy"] = (
        "default-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
    )
    response.headers["referrer-policy"] = "same-origin"
    if visitor is not None and visitor.new_csrf:
        response.set_cookie(
            CSRF_COOKIE,
            visitor.csrf,
            path=base(request) + "/",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
    return response


def routes_of(path: str, endpoint: Callable[..., Any], methods: list[str]) -> list[Route]:
    """A page and its ``.json`` twin."""
    return [
        Route(path, endpoint, methods=methods),
        Route(path + ".json", endpoint, methods=methods),
    ]
