"""The Idempotency keys page (HTTP): keys by route and condition in keyset pages, one
key's stored status, headers and expiry (its body only with ``show_bodies``), and purging
a key that is expired or stuck; consumerdedup.http.key_records does the work."""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import urlencode

from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..http import key_records
from ..telemetry.readings import KEY_CONDITIONS
from .audit import audited
from .confirm import reason_of
from .paging import next_link
from .picks import pairs_of
from .render import page, routes_of


def routes() -> list[Route]:
    return [
        *routes_of("/keys", listing, ["GET"]),
        *routes_of("/keys/record", record, ["GET"]),
        *routes_of("/keys/preview", preview, ["POST"]),
        *routes_of("/keys/apply", apply, ["POST"]),
    ]


async def listing(request: Request) -> Response:
    app = request.app.state
    visitor = await app.access.visitor(request)
    route = request.query_params.get("route", "").strip() or None
    condition = request.query_params.get("condition") or None
    after = request.query_params.get("after") or None
    found = await run_in_threadpool(
        key_records.list_keys,
        app.engine,
        condition=condition,
        route=route,
        after=after,
        tables=app.tables,
    )
    search = {k: v for k, v in (("route", route), ("condition", condition)) if v}
    data = {
        "search": search,
        "conditions": list(KEY_CONDITIONS),
        "records": [_shown(r) for r in found.records],
        "next_cursor": found.next_cursor,
        "next": next_link(search, found.next_cursor),
    }
    return page(request, visitor, "keys.html", data, title="Idempotency keys")


async def record(request: Request) -> Response:
    app = request.app.state
    visitor = await app.access.visitor(request)
    scope = request.query_params.get("scope", "")
    key = request.query_params.get("key", "")
    found = await run_in_threadpool(key_records.show_key, app.engine, scope, key, tables=app.tables)
    if found is None:
        raise HTTPException(404, f"no idempotency key {key!r:.300} in {scope!r:.300}")
    shown = found.as_dict(body=app.show_bodies)
    if not app.show_bodies:
        if found.body is not None:
            shown["body"] = "(hidden: admin_app(show_bodies=True) shows it)"
        shown["headers"] = masked(found.headers)
    data = {"record": shown, "pick": json.dumps([found.scope, found.key])}
    return page(request, visitor, "key.html", data, title="Idempotency key")


async def preview(request: Request) -> Response:
    app = request.app.state
    visitor, form = await app.access.actor(request)
    chosen = _chosen(form)
    found = await run_in_threadpool(
        key_records.purge, app.engine, chosen, dry_run=True, tables=app.tables
    )
    data = {"picks": [json.dumps(list(k)) for k in chosen], "count": len(found)}
    return page(request, visitor, "keys_confirm.html", data, title="Confirm purge")


async def apply(request: Request) -> Response:
    app = request.app.state
    visitor, form = await app.access.actor(request)
    chosen = _chosen(form)
    reason = reason_of(form)
    target = {"scopes": sorted({s for s, _ in chosen})}
    with audited(app, visitor, "keys.purge", target, reason) as purged:
        done = await run_in_threadpool(key_records.purge, app.engine, chosen, tables=app.tables)
        purged += [k for _, k in done]
    data = {"count": len(done), "asked": len(chosen), "keys": [k for _, k in done][:100]}
    return page(request, visitor, "keys_done.html", data, title="purge done")


CREDENTIAL = re.compile(r"(?i)auth|cookie|token|secret|api-?key|session|password")


def masked(headers: Any) -> Any:
    """Stored response headers with the value of any that looks like a credential masked
    (the store drops Set-Cookie; an app's own ``X-Session-Token`` it keeps and replays)."""
    if not isinstance(headers, list):
        return headers
    return [
        [pair[0], "***"]
        if isinstance(pair, list) and pair and CREDENTIAL.search(str(pair[0]))
        else pair
        for pair in headers
    ]


def _chosen(form: Any) -> list[tuple[str, str]]:
    chosen = pairs_of(form, "pick", "key")
    if not chosen:
        raise HTTPException(400, "choose at least one key")
    return chosen


def _shown(r: key_records.KeyRecord) -> dict[str, Any]:
    return {
        **r.as_dict(),
        "pick": json.dumps([r.scope, r.key]),
        "link": "keys/record?" + urlencode({"scope": r.scope, "key": r.key}),
        "purgeable": r.condition in ("expired", "abandoned"),
    }
