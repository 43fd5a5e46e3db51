"""The Dedup explorer: was message X processed by consumer Y, when, with what outcome.
One lookup (consumerdedup.failed.records.states, the replay's own); a FAILED record links
to its page, where it can be forgotten or replayed. A completed record is never
forgotten from here: deleting it would let a redelivery apply the message twice."""

from __future__ import annotations

import json
from urllib.parse import urlencode

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..failed import records
from .render import page, routes_of


def routes() -> list[Route]:
    return routes_of("/explorer", explorer, ["GET"])


async def explorer(request: Request) -> Response:
    app = request.app.state
    visitor = await app.access.visitor(request)
    consumer = request.query_params.get("consumer", "").strip()
    message_id = request.query_params.get("id", "")
    found: dict[str, object] | None = None
    if consumer and message_id:
        states = await run_in_threadpool(
            records.states, app.engine, [(consumer, message_id)], tables=app.tables
        )
        state = states.get((consumer, message_id))
        found = {"consumer": consumer, "message_id": message_id, "recorded": state is not None}
        if state is not None:
            found["outcome"], found["at"] = state[0], state[1].isoformat()
            if state[0] == records.FAILED:
                query = urlencode({"consumer": consumer, "id": message_id})
                found["record"] = f"failures/record?{query}"
                found["key"] = json.dumps([consumer, message_id])
    data = {"consumer": consumer, "message_id": message_id, "found": found}
    return page(request, visitor, "explorer.html", data, title="Dedup explorer")
