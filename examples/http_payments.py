"""A retried POST /payments charges once; its event is published and applied once downstream.

The API is FastAPI behind IdempotencyMiddleware in transactional mode: the payment row, its
outbox event and the stored response commit in one transaction, before the response is sent.
The OutboxRelay publishes the event (here to the in-memory broker, which delivers some
messages twice, as real brokers may); a consumer applies it through a Deduplicator.

Run with CONSUMERDEDUP_DB_URL=postgresql+psycopg://user@host/db (default: local test db). It
serves the API with uvicorn on a free loopback port and calls it with httpx.
"""

import asyncio
import os
import socket
import threading
import time
import uuid

import httpx
import uvicorn
from fastapi import FastAPI, Request
from pydantic import BaseModel
from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from consumerdedup import Deduplicator, Message, Outbox, OutboxRelay, Tables, install
from consumerdedup.http import IdempotencyMiddleware
from consumerdedup.http.fastapi import TransactionalSession
from consumerdedup.testing import MemoryBroker, MemoryConsumerRunner

URL = os.environ.get("CONSUMERDEDUP_DB_URL", "postgresql+psycopg://postgres@127.0.0.1/test")
SCHEMA = "example_http"
tables = Tables.define(f"{SCHEMA}.processed_events", f"{SCHEMA}.outbox")
outbox = Outbox(tables)
api_engine = create_async_engine(URL)


class Payment(BaseModel):
    account: str
    amount: int


app = FastAPI()


@app.post("/payments", status_code=201)
async def pay(
    payment: Payment,
    request: Request,
    session: AsyncSession = TransactionalSession(required=True),  # noqa: B008
) -> dict[str, object]:
    """Charge once per Idempotency-Key: the row, the event and the response commit together."""
    row = await session.execute(
        text(
            f"INSERT INTO {SCHEMA}.payments (account, amount) VALUES (:account, :amount) "
            "RETURNING id"
        ),
        payment.model_dump(),
    )
    payment_id = row.scalar_one()
    body = payment.model_dump_json().encode()
    await outbox.add(session, "payments", body, key=payment.account)  # published by the relay
    return {"payment": payment_id, **payment.model_dump()}


def caller(scope: dict) -> str | None:
    """Who is calling: a multi-tenant API must scope keys by it (here, the API key)."""
    headers = dict(scope["headers"])
    key = headers.get(b"x-api-key")
    return key.decode() if key else None


api = IdempotencyMiddleware(app, api_engine, routes=app.routes, principal=caller, tables=tables)


def serve() -> tuple[uvicorn.Server, threading.Thread, str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(api, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:  # the server says when it listens
        if time.monotonic() > deadline or not thread.is_alive():
            raise SystemExit("the API server did not start")
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


async def clients(url: str) -> dict[str, int]:
    """A client retries after a timeout; ten more retry at once; a second payment; a 422."""
    headers = {"X-Api-Key": "shop-1", "Idempotency-Key": str(uuid.uuid4())}
    alice = {"account": "alice", "amount": 25}
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        first = await client.post("/payments", json=alice, headers=headers)
        retries = await asyncio.gather(
            *(client.post("/payments", json=alice, headers=headers) for _ in range(10))
        )
        bob = await client.post(
            "/payments",
            json={"account": "bob", "amount": 40},
            headers={**headers, "Idempotency-Key": str(uuid.uuid4())},
        )
        reused = await client.post("/payments", json={**alice, "amount": 99}, headers=headers)
    assert first.status_code == 201 and "idempotent-replayed" not in first.headers
    assert all(r.status_code == 201 and r.json() == first.json() for r in retries)
    assert all(r.headers["idempotent-replayed"] == "true" for r in retries)
    assert bob.status_code == 201 and reused.status_code == 422  # same key, another body
    return {"requests": 13, "replayed": len(retries)}


def main() -> None:
    engine = create_engine(URL)
    with engine.begin() as conn:
        conn.execute(text(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
    install(engine, tables)
    with engine.begin() as conn:
        conn.execute(
            text(
                f"CREATE TABLE {SCHEMA}.payments (id serial PRIMARY KEY, account text, amount int)"
            )
        )
        conn.execute(text(f"CREATE TABLE {SCHEMA}.balances (account text, amount int)"))

    server, thread, url = serve()
    try:
        calls = asyncio.run(clients(url))
    finally:
        server.should_exit = True
        thread.join(30)

    broker = MemoryBroker(duplicate_rate=0.5, seed=7)  # delivers some events twice
    published = OutboxRelay(engine, broker, tables=tables).drain()

    dedup = Deduplicator(engine, consumer="balances", tables=tables)

    @dedup.handler
    def apply(message: Message, session: Session) -> None:
        session.execute(
            text(f"INSERT INTO {SCHEMA}.balances VALUES (:account, :amount)"), message.json()
        )

    MemoryConsumerRunner(apply, "payments", broker=broker).run(until_idle=True)

    with engine.connect() as conn:
        payments = conn.execute(text(f"SELECT count(*) FROM {SCHEMA}.payments")).scalar()
        balance = conn.execute(
            text(f"SELECT account, sum(amount) FROM {SCHEMA}.balances GROUP BY 1 ORDER BY 1")
        ).all()
    print(f"{calls['requests']} requests, {calls['replayed']} replayed: payments {payments}")
    print(f"events published: {published}, deliveries: {broker.delivered}, {dedup.counts}")
    print("balances: " + ", ".join(f"{account} {amount}" for account, amount in balance))
    assert payments == 2 and published == 2
    assert [tuple(row) for row in balance] == [("alice", 25), ("bob", 40)]
    with engine.begin() as conn:
        conn.execute(text(f"DROP SCHEMA {SCHEMA} CASCADE"))
    engine.dispose()
    asyncio.run(api_engine.dispose())


if __name__ == "__main__":
    main()
