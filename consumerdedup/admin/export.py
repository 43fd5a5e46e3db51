"""Exporting a Failures search: every record it matches, streamed page by page through
list_failed, as NDJSON or CSV."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ..failed import records
from .search import filters_of, search_of


def routes() -> list[Route]:
    return [Route("/failures/export", export, methods=["GET"])]


async def export(request: Request) -> Response:
    """Every record the search matches, streamed page by page: NDJSON (one JSON object a
    line) or CSV (``format=csv``; a cell a spreadsheet would run as a formula is quoted
    with a leading apostrophe: ids and reasons are the producers' text)."""
    app = request.app.state
    await app.access.visitor(request)
    kind = request.query_params.get("format", "ndjson")
    if kind not in ("ndjson", "csv"):
        raise HTTPException(400, "format must be ndjson or csv")
    filters = filters_of(search_of(request.query_params))

    def lines() -> Iterator[str]:
        if kind == "csv":
            yield "consumer,message_id,failed_at,reason\r\n"
        after: str | None = None
        while True:
            found = records.list_failed(
                app.engine, filters, limit=records.MAX_LIMIT, after=after, tables=app.tables
            )
            for r in found.records:
                if kind == "csv":
                    yield _csv_row([r.consumer, r.message_id, r.failed_at.isoformat(), r.reason])
                else:
                    yield json.dumps(r.as_dict()) + "\n"
            if found.next_cursor is None:
                return
            after = found.next_cursor

    media = "text/csv; charset=utf-8" if kind == "csv" else "application/x-ndjson"
    name = f"failed-records.{kind}"
    headers = {"content-disposition": f'attachment; filename="{name}"'}
    return StreamingResponse(lines(), media_type=media, headers=headers)


def _csv_row(cells: list[str | None]) -> str:
    out = io.StringIO()
    safe = ["'" + c if c and c[0] in "=+-@\t\r" else (c or "") for c in cells]
    csv.writer(out).writerow(safe)
    return out.getvalue()
