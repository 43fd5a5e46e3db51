"""The Failures page: FAILED records grouped by consumer and reason, searched on the
server (consumer, message id prefix, reason text, time range) in keyset pages; one
record's page; forget or replay one record, a selection, or every record the search
matches (a preview says how many, then a confirmation with a reason)."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlencode

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..errors import ConfigurationError
from ..failed import records
from .audit import audited
from .confirm import check_confirmed, reason_of
from .paging import next_link
from .picks import pairs_of
from .render import page, routes_of
from .search import filters_of, search_of

PAGE_SIZE = 50
LIVE_SECONDS = 10
"""How often the Failures page re-reads itself where JavaScript is on (``?live=N``
seconds, 2 to 3600; ``?live=0``: never): each read runs the list and the groups."""
ACTIONS = ("forget", "replay")


def routes() -> list[Route]:
    return [
        *routes_of("/failures", listing, ["GET"]),
        *routes_of("/failures/record", record, ["GET"]),
        *routes_of("/failures/preview", preview, ["POST"]),
        *routes_of("/failures/apply", apply, ["POST"]),
    ]


async def listing(request: Request) -> Response:
    app = request.app.state
    visitor = await app.access.visitor(request)
    search = search_of(request.query_params)
    filters = filters_of(search)
    limit = _limit(request.query_params.get("limit"))
    after = request.query_params.get("after") or None
    found = await run_in_threadpool(
        records.list_failed, app.engine, filters, limit=limit, after=after, tables=app.tables
    )
    grouped = await run_in_threadpool(records.groups, app.engine, filters, tables=app.tables)
    rows = [
        {**r.as_dict(), "key": json.dumps([r.consumer, r.message_id]), "link": _link(r)}
        for r in found.records
    ]
    data = {
        "search": search,
        "export": "failures/export?" + urlencode(search),
        "groups": [{"consumer": g.consumer, "reason": g.reason, "count": g.count} for g in grouped],
        "records": rows,
        "next_cursor": found.next_cursor,
        "next": next_link(search, found.next_cursor, limit=limit),
        "can_replay": app.replay is not None,
        "live": _live(request.query_params.get("live")),
    }
    return page(request, visitor, "failures.html", data, title="Failures")


async def record(request: Request) -> Response:
    app = request.app.state
    visitor = await app.access.visitor(request)
    consumer = request.query_params.get("consumer", "")
    message_id = request.query_params.get("id", "")
    found = await run_in_threadpool(
        records.show, app.engine, consumer, message_id, tables=app.tables
    )
    if found is None:
        raise HTTPException(404, f"no FAILED record of {message_id!r:.300} for {consumer!r:.100}")
    data = {
        "record": found.as_dict(),
        "key": json.dumps([found.consumer, found.message_id]),
        "can_replay": app.replay is not None,
    }
    return page(request, visitor, "record.html", data, title="FAILED record")


async def preview(request: Request) -> Response:
    """What an action would do: how many records, before anything changes."""
    app = request.app.state
    visitor, form = await app.access.actor(request)
    action, scope, search, chosen = _request_of(form, app.replay is not None)
    if scope == "matching":
        total = await run_in_threadpool(
            records.count, app.engine, filters_of(search), tables=app.tables
        )
    else:
        total = await run_in_threadpool(_still_failed, app, chosen)
    data = {
        "action": action,
        "scope": scope,
        "search": search,
        "keys": [json.dumps(list(k)) for k in chosen],
        "count": total,
    }
    return page(request, visitor, "confirm.html", data, title=f"Confirm {action}")


async def apply(request: Request) -> Response:
    """The action, confirmed, with its reason; written to the audit trail."""
    app = request.app.state
    visitor, form = await app.access.actor(request)
    action, scope, search, chosen = _request_of(form, app.replay is not None)
    reason = reason_of(form)
    if scope == "matching":
        by_consumer = await run_in_threadpool(
            records.matching, app.engine, filters_of(search), tables=app.tables
        )
        check_confirmed(form, sum(len(ids) for ids in by_consumer.values()))
    else:
        by_consumer = {}
        for consumer, message_id in chosen:
            by_consumer.setdefault(consumer, []).append(message_id)
    target = {"scope": scope, "search": search, "consumers": sorted(by_consumer)}
    kept: list[str] = []
    with audited(app, visitor, f"failed.{action}", target, reason) as done:
        for consumer, ids in by_consumer.items():
            if action == "forget":
                done += await run_in_threadpool(
                    records.forget, app.engine, consumer, ids, tables=app.tables
                )
            else:
                report = await run_in_threadpool(app.replay, app.engine, app.tables, consumer, ids)
                done += [str(x.message_id) for x in report.replayed]
                kept += [f"{x.message_id}: {why}" for x, why in report.kept]
    data = {
        "action": action,
        "count": len(done),
        "ids": done[:100],
        "kept": kept[:100],
        "asked": sum(len(ids) for ids in by_consumer.values()),
        "search": search,
    }
    return page(request, visitor, "done.html", data, title=f"{action} done")


def _request_of(
    form: FormData, can_replay: bool
) -> tuple[str, str, dict[str, str], list[tuple[str, str]]]:
    action = str(form.get("action") or "")
    if action not in ACTIONS or (action == "replay" and not can_replay):
        raise HTTPException(400, f"action must be forget{' or replay' if can_replay else ''}")
    scope = str(form.get("scope") or "selected")
    if scope not in ("selected", "matching"):
        raise HTTPException(400, "scope must be selected or matching")
    search = search_of(form)
    chosen = pairs_of(form, "key", "record's key")
    if scope == "selected" and not chosen:
        raise HTTPException(400, "choose at least one record, or act on all that match")
    if scope == "matching":
        filters_of(search)  # a bad time is refused before anything runs
    return action, scope, search, chosen


def _still_failed(app: Any, chosen: list[tuple[str, str]]) -> int:
    by_consumer: dict[str, list[str]] = {}
    for consumer, message_id in chosen:
        by_consumer.setdefault(consumer, []).append(message_id)
    return sum(
        len(records.forget(app.engine, c, ids, dry_run=True, tables=app.tables))
        for c, ids in by_consumer.items()
    )


def _limit(raw: str | None) -> int:
    if raw is None or raw == "":
        return PAGE_SIZE
    if not raw.isdigit():
        raise ConfigurationError(f"limit {raw[:20]!r}: expected 1..{records.MAX_LIMIT}")
    return int(raw)


def _live(raw: str | None) -> int:
    if raw is None or raw == "":
        return LIVE_SECONDS
    if not raw.isdigit() or (raw != "0" and not 2 <= int(raw) <= 3600):
        raise ConfigurationError(f"live {raw[:20]!r}: expected seconds from 2 to 3600, or 0")
    return int(raw)


def _link(r: records.FailedRecord) -> str:
    return "failures/record?" + urlencode({"consumer": r.consumer, "id": r.message_id})
