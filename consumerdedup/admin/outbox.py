"""The Outbox page: the backlog by destination, parked events (and what each holds back
on its key: the head-of-line view) and abandoned ones, in keyset pages; replay (publish
again) or abandon parked events, chosen or all, with a reason. consumerdedup.outbox.parked
does the work, as for ``consumerdedup outbox``."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..outbox import parked
from .audit import audited
from .confirm import check_confirmed, reason_of
from .paging import next_link
from .render import page, routes_of

PAGE_SIZE = 50
ACTIONS = ("replay", "abandon")


def routes() -> list[Route]:
    return [
        *routes_of("/outbox", listing, ["GET"]),
        *routes_of("/outbox/event", event, ["GET"]),
        *routes_of("/outbox/preview", preview, ["POST"]),
        *routes_of("/outbox/apply", apply, ["POST"]),
    ]


async def listing(request: Request) -> Response:
    app = request.app.state
    visitor = await app.access.visitor(request)
    view = request.query_params.get("view", "parked")
    if view not in ("parked", "abandoned"):
        raise HTTPException(400, "view must be parked or abandoned")
    after = request.query_params.get("after") or None
    search = search_of(request.query_params)
    found = await run_in_threadpool(
        parked.list_parked,
        app.engine,
        abandoned=view == "abandoned",
        limit=PAGE_SIZE,
        after=after,
        destination=search.get("destination"),
        key=search.get("key"),
        tables=app.tables,
    )
    destinations = await run_in_threadpool(parked.backlog, app.engine, tables=app.tables)
    data = {
        "view": view,
        "search": search,
        "destinations": destinations,
        "events": [_shown(e.as_dict()) for e in found.events],
        "next_cursor": found.next_cursor,
        "next": next_link({"view": view, **search}, found.next_cursor),
    }
    return page(request, visitor, "outbox.html", data, title="Outbox")


async def event(request: Request) -> Response:
    app = request.app.state
    visitor = await app.access.visitor(request)
    event_id = request.query_params.get("id", "")
    found = await run_in_threadpool(parked.show, app.engine, event_id, tables=app.tables)
    if found is None:
        raise HTTPException(404, f"no outbox event {event_id!r:.300}")
    waiting, first = await run_in_threadpool(parked.behind, app.engine, found, tables=app.tables)
    shown = found.as_dict()
    if not app.show_bodies:  # bodies may hold personal data: shown only when allowed
        for name in ("body", "body_base64"):
            if name in shown:
                shown[name] = "(hidden: admin_app(show_bodies=True) shows it)"
    data = {
        "event": shown,
        "behind": waiting,
        "first_behind": [_shown(e.as_dict()) for e in first],
    }
    return page(request, visitor, "event.html", data, title="Outbox event")


async def preview(request: Request) -> Response:
    app = request.app.state
    visitor, form = await app.access.actor(request)
    action, ids = await _request_of(app, form)
    found = await run_in_threadpool(_change, app, action, ids, "-", "-", True)
    data = {
        "action": action,
        "ids": ids,
        "count": len(found),
        "all": form.get("scope") == "all",
        "search": search_of(form),
    }
    return page(request, visitor, "outbox_confirm.html", data, title=f"Confirm {action}")


async def apply(request: Request) -> Response:
    app = request.app.state
    visitor, form = await app.access.actor(request)
    action, ids = await _request_of(app, form)
    reason = reason_of(form)
    if form.get("scope") == "all":
        check_confirmed(form, len(ids))
    target = {"scope": str(form.get("scope") or "selected"), "search": search_of(form)}
    with audited(app, visitor, f"outbox.{action}", target, reason) as done:
        done += await run_in_threadpool(_change, app, action, ids, visitor.who, reason, False)
    data = {"action": action, "count": len(done), "ids": done[:100], "asked": len(ids)}
    return page(request, visitor, "outbox_done.html", data, title=f"{action} done")


async def _request_of(app: Any, form: Any) -> tuple[str, list[str]]:
    action = str(form.get("action") or "")
    if action not in ACTIONS:
        raise HTTPException(400, "action must be replay or abandon")
    if form.get("scope") == "all":
        return action, await run_in_threadpool(_every_parked, app, search_of(form))
    ids = [str(v) for v in form.getlist("id")]
    if not ids:
        raise HTTPException(400, "choose at least one event, or act on all parked events")
    return action, list(dict.fromkeys(ids))


def _change(app: Any, action: str, ids: list[str], by: str, reason: str, dry: bool) -> list[str]:
    if action == "replay":
        return parked.replay(app.engine, ids, dry_run=dry, tables=app.tables)
    return parked.abandon(app.engine, ids, by=by, reason=reason, dry_run=dry, tables=app.tables)


def search_of(source: Any) -> dict[str, str]:
    """The outbox search given (destination, key; exact), empty ones left out."""
    return {name: str(source.get(name)) for name in ("destination", "key") if source.get(name)}


def _every_parked(app: Any, search: dict[str, str]) -> list[str]:
    ids: list[str] = []
    after: str | None = None
    while True:
        found = parked.list_parked(
            app.engine,
            limit=parked.MAX_LIMIT,
            after=after,
            destination=search.get("destination"),
            key=search.get("key"),
            tables=app.tables,
        )
        ids += [e.event_id for e in found.events]
        if found.next_cursor is None:
            return ids
        after = found.next_cursor


def _shown(event: dict[str, Any]) -> dict[str, Any]:
    return {**event, "link": "outbox/event?" + urlencode({"id": event["event_id"]})}
