"""``admin_app(engine, ...)``: the operator's web pages as one Starlette application,
mounted in the user's own app (``app.mount("/admin", admin_app(engine, authorize=...))``)
or served by ``consumerdedup admin``.

Every page reads through the same library functions as the CLI (consumerdedup.failed,
consumerdedup.outbox.parked, consumerdedup.telemetry.readings, consumerdedup.doctor): no
query of its own. Database calls are synchronous and run in Starlette's thread pool.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

from sqlalchemy import Engine
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount
from starlette.staticfiles import StaticFiles

from ..errors import ConfigurationError
from ..options import boolean, instance, maybe, text
from ..reasons import describe
from ..schema import DEFAULT, Tables
from . import audit_page, explorer, export, failures, keys, login, outbox, overview
from .audit import Audit, log_entry
from .audit_table import AuditTable
from .render import page
from .replay import DeadLetterReplay
from .security import Access, Authorize

log = logging.getLogger("consumerdedup.admin")
STATIC = Path(__file__).parent / "static"


def admin_app(
    engine: Engine,
    *,
    tables: Tables = DEFAULT,
    authorize: Authorize | None = None,
    allow_loopback: bool = False,
    token: str | None = None,
    actions: bool = False,
    replay: DeadLetterReplay | None = None,
    audit: Audit | Literal["table"] | None = None,
    show_bodies: bool = False,
    title: str = "consumerdedup",
) -> Starlette:
    """The admin pages over ``engine``'s ``tables``.

    Deny by default: ``authorize(request) -> Role | Grant | None`` decides who sees and who
    acts; without it, ``allow_loopback=True`` must say that any client on this host may
    (then a ConfigurationError otherwise). ``token``: every request must carry it too.
    Read-only unless ``actions=True`` (and then only for the OPERATOR role). ``replay``
    moves FAILED messages' dead letters back (``RabbitMQReplay``); without it only
    forget is offered. ``audit`` receives every action (default: a JSON log line on
    ``consumerdedup.admin.audit``; ``"table"``: rows of the library's ``admin_audit``
    table, shown on the Audit page, which must exist: ``consumerdedup init-db
    --admin-audit``; an ``AuditTable`` for another name). ``show_bodies``: outbox bodies are shown.
    """
    instance(engine, "engine", Engine, "a sqlalchemy Engine")
    instance(tables, "tables", Tables, "a consumerdedup Tables")
    if authorize is not None and not callable(authorize):
        raise ConfigurationError(f"authorize must be callable, got {authorize!r:.80}")
    boolean(allow_loopback, "allow_loopback")
    boolean(actions, "actions")
    boolean(show_bodies, "show_bodies")
    maybe(token, "token", text)
    if token is not None and len(token) < 16:
        raise ConfigurationError("token must be at least 16 characters (got a shorter one)")
    if authorize is None and not allow_loopback and token is None:
        raise ConfigurationError(
            "admin_app needs authorize= (your app's auth: a callable returning Role.VIEWER, "
            "Role.OPERATOR or None), or token=, or allow_loopback=True to let any client on "
            "this host in"
        )
    if replay is not None and not callable(replay):
        raise ConfigurationError(f"replay must be callable, got {replay!r:.80}")
    if audit == "table":
        audit = AuditTable(engine, tables=tables)
    if audit is not None and not callable(audit):
        raise ConfigurationError(f"audit must be callable or 'table', got {audit!r:.80}")
    audit_table = audit.check() if isinstance(audit, AuditTable) else None
    text(title, "title")
    routes: list[BaseRoute] = [
        *overview.routes(),
        *failures.routes(),
        *export.routes(),
        *explorer.routes(),
        *outbox.routes(),
        *keys.routes(),
        *audit_page.routes(),
        *login.routes(),
        Mount("/static", app=StaticFiles(directory=STATIC), name="static"),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={HTTPException: _refused, ConfigurationError: _bad, Exception: _failed},
    )
    app.state.engine = engine
    app.state.tables = tables
    app.state.access = Access(authorize, allow_loopback, token, actions)
    app.state.replay = replay
    app.state.audit = audit if audit is not None else log_entry
    app.state.audit_table = audit_table
    app.state.show_bodies = show_bodies
    app.state.title = title
    return app


async def _refused(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    data = {"error": error.detail, "status": error.status_code}
    response = page(request, None, "error.html", data, status=error.status_code, title="refused")
    if error.status_code == 401:
        response.headers["www-authenticate"] = "Bearer"
    return response


async def _bad(request: Request, error: Exception) -> Response:
    """A bad cursor, limit or time in the query: 400, with what is expected."""
    data = {"error": str(error), "status": 400}
    return page(request, None, "error.html", data, status=400, title="bad request")


async def _failed(request: Request, error: Exception) -> Response:
    log.error("admin page %s failed: %s", request.url.path, describe(error))
    data = {"error": describe(error), "status": 500}
    return page(request, None, "error.html", data, status=500, title="error")
