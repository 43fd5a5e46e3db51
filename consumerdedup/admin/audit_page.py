"""The Audit page: the actions taken from these pages, newest first, in keyset pages
(``?before=ID``), read from the ``admin_audit`` table when ``admin_app(audit="table")``
(or an ``AuditTable``) writes the trail there; absent otherwise."""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..errors import ConfigurationError
from .audit_table import MAX_LIMIT
from .render import page, plain, routes_of

PAGE_SIZE = 50


def routes() -> list[Route]:
    return routes_of("/audit", listing, ["GET"])


async def listing(request: Request) -> Response:
    app = request.app.state
    visitor = await app.access.visitor(request)
    if app.audit_table is None:
        raise HTTPException(404, 'the audit trail is not kept in a table: admin_app(audit="table")')
    limit = _number(request.query_params.get("limit"), "limit", None) or PAGE_SIZE
    before = _number(request.query_params.get("before"), "before", None)
    found = await run_in_threadpool(app.audit_table.recent, min(limit, MAX_LIMIT), before)
    data = {
        "table": app.audit_table.table.fullname,
        "entries": plain(found.rows),
        "before": found.before,
        "next": f"?before={found.before}&limit={limit}" if found.before else None,
    }
    return page(request, visitor, "audit.html", data, title="Audit")


def _number(raw: str | None, name: str, default: int | None) -> int | None:
    if raw is None or raw == "":
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigurationError(f"{name} {raw[:20]!r}: expected a whole number >= 1")
    return int(raw)
