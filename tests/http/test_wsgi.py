"""What only the WSGI middleware must get right (the rules are the shared suite's).

Under a real waitress server with httpx: a chunked request body (waitress de-chunks it) is
read whole and fingerprinted; a legacy ``write()`` response is held and replayed; an app
that raises releases its claim and the server answers 500. Called directly (no server
does it under waitress): a terminated stream with no Content-Length (gunicorn's
``wsgi.input_terminated``) is read to its end, and past max_request_body refused with 413.
And the guards: an asyncio engine or store, no store at all, a transactional route
without an engine.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine
from sqlalchemy.ext.asyncio import create_async_engine

from consumerdedup import ConfigurationError, Tables, install
from consumerdedup.http import IdempotencyPolicy, RoutePolicy, WSGIIdempotencyMiddleware
from consumerdedup.http.redis_store import AsyncRedisStore
from tests.http.conftest import runs_in, serve_wsgi
from tests.http.wsgi_server import WsgiServer


def make_app() -> Any:
    """A bare WSGI app (no framework): /echo echoes, /legacy uses write(), /boom raises."""
    import os

    engine = create_engine(os.environ["CDD_WSGI_DB"])
    counter = Path(os.environ["CDD_WSGI_RUNS"])

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        body = environ["wsgi.input"].read()
        with counter.open("a") as runs:
            runs.write(environ["PATH_INFO"] + "\n")
        if environ["PATH_INFO"] == "/boom":
            raise RuntimeError("the endpoint failed")
        headers = [("Content-Type", "application/octet-stream")]
        if environ["PATH_INFO"] == "/legacy":
            write = start_response("201 Created", headers)
            write(b"written: ")
            write(body)
            return []
        start_response("201 Created", headers)
        return [b"echo: ", body]

    policy = IdempotencyPolicy.of({"/*": RoutePolicy(required=True)})
    return WSGIIdempotencyMiddleware(app, engine, policy=policy)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[WsgiServer, Path]]:
    yield from serve_wsgi(
        tmp_path_factory.mktemp("wsgi"), "tests.http.test_wsgi:make_app", "CDD_WSGI"
    )


def test_a_chunked_body_is_read_whole_fingerprinted_and_replayed(
    server: tuple[WsgiServer, Path],
) -> None:
    running, runs = server
    key, parts = uuid.uuid4().hex, [b"a" * 70_000, b"b" * 70_000, b"end"]
    before = runs_in(runs, "/echo")

    def send(chunks: list[bytes]) -> httpx.Response:
        return httpx.post(
            running.url + "/echo",
            content=iter(chunks),  # no length known: Transfer-Encoding: chunked
            headers={"Idempotency-Key": key},
            timeout=30,
        )

    first = send(parts)
    assert first.status_code == 201 and first.content == b"echo: " + b"".join(parts)
    again = send(parts)
    assert again.headers["idempotent-replayed"] == "true" and again.content == first.content
    assert send([*parts[:2], b"END"]).status_code == 422  # the last chunk counts
    assert runs_in(runs, "/echo") == before + 1


def test_a_response_written_with_write_is_held_and_replayed(
    server: tuple[WsgiServer, Path],
) -> None:
    running, runs = server
    key = uuid.uuid4().hex
    calls = [
        httpx.post(running.url + "/legacy", content=b"x", headers={"Idempotency-Key": key})
        for _ in range(2)
    ]
    assert [c.content for c in calls] == [b"written: x"] * 2
    assert "idempotent-replayed" not in calls[0].headers
    assert calls[1].headers["idempotent-replayed"] == "true"
    assert runs_in(runs, "/legacy") == 1


def test_an_app_that_raises_answers_500_and_the_retry_runs_again(
    server: tuple[WsgiServer, Path],
) -> None:
    running, runs = server
    key = uuid.uuid4().hex
    for _ in range(2):
        answer = httpx.post(running.url + "/boom", content=b"x", headers={"Idempotency-Key": key})
        assert answer.status_code == 500 and "idempotent-replayed" not in answer.headers
    assert runs_in(runs, "/boom") == 2  # the claim was released: nothing stored, never stuck


def _app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    start_response("200 OK", [])
    return [b""]


def test_an_asyncio_engine_or_store_is_refused(tmp_path: Path) -> None:
    async_engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'a.db'}")
    with pytest.raises(ConfigurationError, match="blocking SQLAlchemy Engine"):
        WSGIIdempotencyMiddleware(_app, async_engine)  # type: ignore[arg-type]
    store = AsyncRedisStore.from_url("redis://127.0.0.1:6379/0")
    with pytest.raises(ConfigurationError, match="blocking method"):
        WSGIIdempotencyMiddleware(_app, store=store)
    with pytest.raises(ConfigurationError, match="needs an engine or a store"):
        WSGIIdempotencyMiddleware(_app)


def test_a_transactional_route_without_an_engine_is_refused_at_construction() -> None:
    """Before issue 38 it was refused at the first request only."""
    from consumerdedup.http.redis_store import RedisStore

    policy = IdempotencyPolicy.of(
        {"/pay": RoutePolicy(transactional=True, lease=timedelta(seconds=5))}
    )
    with pytest.raises(ConfigurationError, match="needs the middleware's engine"):
        WSGIIdempotencyMiddleware(
            _app, store=RedisStore.from_url("redis://127.0.0.1:6379/0"), policy=policy
        )


def test_a_terminated_input_without_length_is_read_to_its_end(tmp_path: Path) -> None:
    import io

    engine = create_engine(f"sqlite:///{tmp_path / 'k.db'}")
    install(engine, Tables.define())
    seen: list[bytes] = []

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        seen.append(environ["wsgi.input"].read())
        start_response("201 Created", [("Content-Type", "text/plain")])
        return [b"ok"]

    small = RoutePolicy(required=True, max_request_body=10)
    policy = IdempotencyPolicy.of({"/small": small}, default=RoutePolicy(required=True))
    middleware = WSGIIdempotencyMiddleware(app, engine, policy=policy)
    statuses: list[str] = []

    def call(path: str, body: bytes) -> bytes:
        environ = {
            "REQUEST_METHOD": "POST",
            "PATH_INFO": path,
            "HTTP_IDEMPOTENCY_KEY": uuid.uuid4().hex,
            "wsgi.input": io.BytesIO(body),
            "wsgi.input_terminated": True,
        }
        return b"".join(middleware(environ, lambda status, headers, *_: statuses.append(status)))

    assert call("/echo", b"x" * 100_000) == b"ok" and seen == [b"x" * 100_000]
    assert statuses[-1].startswith("201")
    assert b"request-too-large" in call("/small", b"y" * 11) and statuses[-1].startswith("413")
    assert len(seen) == 1  # the oversized request never reached the app
