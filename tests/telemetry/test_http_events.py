"""The HTTP idempotency middleware's decisions as span events on the request's span."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine

from consumerdedup import install
from consumerdedup.http import IdempotencyMiddleware
from tests.telemetry.conftest import Otel


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 201, "headers": []})
    await send({"type": "http.response.body", "body": b'{"paid": true}'})


async def test_stored_then_replayed_are_events_on_the_request_span(
    tmp_path: Path, otel: Otel
) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'keys.db'}")
    install(engine)
    transport = httpx.ASGITransport(app=IdempotencyMiddleware(app, engine))
    tracer = otel.tracer_provider.get_tracer("test")
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        for _ in range(2):
            with tracer.start_as_current_span("POST /payments"):
                key = {"Idempotency-Key": "k-1"}
                got = await client.post("/payments", content=b"{}", headers=key)
                assert got.status_code == 201
    first, second = otel.named("POST /payments")
    decisions = [
        [dict(e.attributes or {}) for e in span.events if e.name == "consumerdedup.idempotency"]
        for span in (first, second)
    ]
    assert decisions == [
        [{"consumerdedup.idempotency.decision": "stored"}],
        [{"consumerdedup.idempotency.decision": "replayed", "http.response.status_code": 201}],
    ]
    engine.dispose()
