"""Round trips to PostgreSQL per request, for each of bench_http's ``/pay`` configurations.

Run it: ``.venv/bin/python bench/http_round_trips.py`` (PostgreSQL as bench_http; a fresh
schema, dropped at the end). It serves bench/http_apps.py's app in this process (httpx's
ASGI transport, one request at a time), with libpq's trace on every connection of the
server's engine, and counts per request the server's ReadyForQuery messages (one per
wait for PostgreSQL: a simple query or a pipeline's Sync) and the statements sent
(Execute messages and simple queries). Counts, not times: the same on a busy machine.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import uuid
from collections import Counter
from typing import Any

import httpx
import sqlalchemy.ext.asyncio
from psycopg import pq
from sqlalchemy import create_engine, event

sys.path.insert(0, os.path.dirname(__file__))
import http_apps
from bench_http import PG_URL, REDIS_URL

REQUESTS = 20
CONFIGURATIONS = [  # (label, path, keyed, replays)
    ("bare: INSERT, commit", "/bare/pay", False, False),
    ("SQL store, unique keys", "/sql/pay", True, False),
    ("SQL store, replays", "/sql/pay", True, True),
    ("transactional, unique keys", "/tx/pay", True, False),
    ("transactional, replays", "/tx/pay", True, True),
]


def traced_engines(trace: Any) -> None:
    """Every async engine made from now on traces its connections into ``trace``."""
    make = sqlalchemy.ext.asyncio.create_async_engine

    def create(*args: Any, **kwargs: Any) -> Any:
        engine = make(*args, **kwargs)

        @event.listens_for(engine.sync_engine, "connect")
        def on_connect(dbapi_connection: Any, _: Any) -> None:
            pgconn = dbapi_connection.driver_connection.pgconn
            pgconn.trace(trace.fileno())
            pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)

        return engine

    sqlalchemy.ext.asyncio.create_async_engine = create  # http_apps imports it at build


def read(trace: Any) -> Counter[str]:
    """The messages traced since the last read, by direction and type (then cleared)."""
    trace.flush()
    trace.seek(0)
    found: Counter[str] = Counter()
    for line in trace.read().splitlines():
        fields = line.split("\t")
        if len(fields) > 2:
            found[f"{fields[0]} {fields[2].split()[0]}"] += 1
    trace.seek(0)
    trace.truncate()
    return found


async def measure(app: Any, trace: Any, tag: str) -> None:
    body = json.dumps({"amount": 1, "pad": "x" * 200}).encode()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:

        async def post(path: str, key: str | None) -> None:
            headers = {"content-type": "application/json"}
            if key is not None:
                headers["idempotency-key"] = key
            answer = await client.post(path, content=body, headers=headers)
            if answer.status_code not in (200, 201):
                raise SystemExit(f"{path}: HTTP {answer.status_code} {answer.text[:300]}")

        print(f"{'configuration':<28} {'waits':>6} {'statements':>10}  (per request)")
        for number, (label, path, keyed, replays) in enumerate(CONFIGURATIONS):
            keys = [f"{tag}-{number}-{i}" if keyed else None for i in range(REQUESTS)]
            for key in keys if replays else [f"{tag}-{number}-warm-{i}" for i in range(5)]:
                await post(path, key if replays or keyed else None)  # warm: pool, prepared
            read(trace)
            for key in keys:
                await post(path, key)
            counts = read(trace)
            waits = counts["B ReadyForQuery"] / REQUESTS
            statements = (counts["F Execute"] + counts["F Query"]) / REQUESTS
            print(f"{label:<28} {waits:6.2f} {statements:10.2f}")


def main() -> None:
    tag = uuid.uuid4().hex[:8]
    schema, prefix = f"bench_trips_{tag}", f"bench-trips-{tag}:"
    engine = create_engine(PG_URL)
    http_apps.create_schema(engine, schema)
    try:
        with tempfile.TemporaryFile("w+") as trace:
            traced_engines(trace)
            app = http_apps.build(PG_URL, REDIS_URL, schema, prefix, False)
            asyncio.run(measure(app, trace, tag))
    finally:
        http_apps.drop_schema(engine, schema)
        engine.dispose()


if __name__ == "__main__":
    main()
