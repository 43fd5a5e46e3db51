"""The Overview page: the readings ``stats`` prints (per consumer its records and FAILED
count, the outbox's backlog and oldest unpublished age, parked and abandoned events, the
HTTP idempotency keys) and the doctor's checks, read fresh on every load."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..doctor import diagnose
from ..outbox import parked
from ..telemetry.history import history
from ..telemetry.readings import Readings, key_stats
from .render import page, routes_of


def routes() -> list[Route]:
    return [Route("/", overview, methods=["GET"]), *routes_of("/overview", overview, ["GET"])]


def database(engine: Any) -> str:
    """The database as it may be shown: no user, no password, no query parameters."""
    url = engine.url
    where = f"{url.host}:{url.port}" if url.host else ""
    return f"{url.get_backend_name()}://{where}/{url.database or ''}"


def read(engine: Any, tables: Any) -> dict[str, Any]:
    readings = Readings.take(engine, tables)
    return {
        "read_at": datetime.now(UTC).isoformat(),
        "database": database(engine),
        "tables": {
            "processed_events": tables.processed_events.fullname,
            "outbox": tables.outbox.fullname,
            "idempotency_keys": tables.idempotency_keys.fullname,
        },
        "consumers": readings.consumers,
        "outbox": readings.outbox,
        "destinations": parked.backlog(engine, tables=tables),
        "partitions": readings.partitions,
        "idempotency_keys": key_stats(engine, tables.idempotency_keys),
        "checks": [check.as_dict() for check in diagnose(engine, tables)],
        "history": history(engine, tables),
    }


async def overview(request: Request) -> Response:
    app = request.app.state
    visitor = await app.access.visitor(request)
    data = await run_in_threadpool(read, app.engine, app.tables)
    refresh = request.query_params.get("refresh", "")
    # A page left open re-reads every ``refresh`` seconds, without JavaScript; each read
    # runs the doctor's counts, so never more often than every 5 seconds.
    data["refresh"] = min(max(int(refresh), 5), 3600) if refresh.isdigit() else None
    return page(request, visitor, "overview.html", data, title="Overview")
