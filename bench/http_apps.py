"""The server side of bench_http: the same FastAPI endpoints under every configuration.

``build`` returns one ASGI app that sends a request to a configuration by its path's first
segment (``/bare``, ``/sql``, ``/tx``, ``/redis``, ``/peer``), without copying or rewriting
the scope: each configuration is its own FastAPI app with its routes at their full paths,
wrapped (or not) in the middleware under test. Every ``/pay`` does the same business INSERT;
every ``/echo`` answers the same JSON without touching a database.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncSession

PAYMENT = "INSERT INTO {schema}.payments (amount, reference) VALUES (:amount, :reference)"


def create_schema(engine: Engine, schema: str) -> None:
    from consumerdedup import install

    with engine.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        conn.execute(
            text(
                f'CREATE TABLE "{schema}".payments '
                "(id bigserial PRIMARY KEY, amount int NOT NULL, reference text)"
            )
        )
    install(engine, tables(schema))


def tables(schema: str) -> Any:
    from consumerdedup import Tables

    return Tables.define(f"{schema}.processed_events", f"{schema}.outbox")


def drop_schema(engine: Engine, schema: str) -> None:
    with engine.begin() as conn:
        conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))


def drop_redis_keys(url: str, prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        for key in client.scan_iter(match=f"{prefix}*", count=1000):
            client.delete(key)
    finally:
        client.close()


def build(pg_url: str, redis_url: str, schema: str, prefix: str, peer: bool) -> Any:
    import redis.asyncio
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(pg_url, pool_size=25, max_overflow=0)
    payment = text(PAYMENT.format(schema=f'"{schema}"'))

    def endpoints(prefix_path: str) -> FastAPI:
        app = FastAPI()

        @app.post(f"{prefix_path}/pay", status_code=201)
        async def pay(request: Request) -> dict[str, Any]:
            body = await request.json()
            async with engine.begin() as conn:
                await conn.execute(payment, {"amount": body["amount"], "reference": None})
            return {"paid": body["amount"]}

        @app.post(f"{prefix_path}/echo")
        async def echo(request: Request) -> dict[str, Any]:
            body = await request.json()
            return {"echo": body["amount"]}

        return app

    apps: dict[str, Any] = {"bare": endpoints("/bare")}
    apps.update(ours(redis_url, schema, prefix, engine, payment, endpoints))
    if peer:
        from idempotency_header_middleware import IdempotencyHeaderMiddleware
        from idempotency_header_middleware.backends import RedisBackend

        backend = RedisBackend(
            redis=redis.asyncio.Redis.from_url(redis_url),
            keys_key=f"{prefix}peer-keys",
            response_key=f"{prefix}peer-responses",
        )
        apps["peer"] = IdempotencyHeaderMiddleware(endpoints("/peer"), backend=backend)

    async def health(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def dispatch(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # lifespan: nothing to start
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
                message = await receive()
            if message["type"] == "lifespan.shutdown":
                await engine.dispose()
                await send({"type": "lifespan.shutdown.complete"})
            return
        first = scope["path"].split("/")[1]
        app = apps.get(first, health)
        await app(scope, receive, send)

    return dispatch


def ours(
    redis_url: str, schema: str, prefix: str, engine: Any, payment: Any, endpoints: Any
) -> dict[str, Any]:
    """The middleware under test: SQL store, transactional mode, Redis store."""
    from consumerdedup.http import IdempotencyMiddleware, IdempotencyPolicy, RoutePolicy
    from consumerdedup.http.fastapi import TransactionalSession
    from consumerdedup.http.redis_store import AsyncRedisStore

    required = RoutePolicy(required=True)
    sql_policy = IdempotencyPolicy.of({"/sql/*": required})
    sql = IdempotencyMiddleware(endpoints("/sql"), engine, policy=sql_policy, tables=tables(schema))

    tx = FastAPI()

    @tx.post("/tx/pay", status_code=201)
    async def pay_tx(
        request: Request,
        session: AsyncSession = TransactionalSession(required=True),  # noqa: B008
    ) -> dict[str, Any]:
        body = await request.json()
        await session.execute(payment, {"amount": body["amount"], "reference": None})
        return {"paid": body["amount"]}

    transactional = IdempotencyMiddleware(tx, engine, routes=tx.routes, tables=tables(schema))
    store = AsyncRedisStore.from_url(redis_url, prefix=f"{prefix}ours:")
    redis_policy = IdempotencyPolicy.of({"/redis/*": required})
    on_redis = IdempotencyMiddleware(endpoints("/redis"), store=store, policy=redis_policy)
    return {"sql": sql, "tx": transactional, "redis": on_redis}
