"""A FastStream consumer process for the SIGKILL tests: ``python faststream_worker.py
SPEC.json``. It consumes with DedupMiddleware into the ledger, appends ``id outcome`` to
the spec's outcomes file for every Result, and SIGKILLs itself right after the COMMIT of
the ``kill_after``-th message it processed (before FastStream's ack), or inside the
``kill_in_handler``-th handler call, after its write and before the COMMIT, if asked. It
calls no ``check()``: the middleware checks on the first delivery."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from typing import Annotated, Any

from faststream import AckPolicy, Context
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from consumerdedup import AsyncDeduplicator, Outcome, Result, Tables
from consumerdedup.faststream import SESSION, DedupMiddleware

Body = dict[str, Any]


def main(spec: dict[str, Any]) -> None:
    engine = create_async_engine(spec["database"])
    tables = Tables.define(f"{spec['schema']}.processed_events", f"{spec['schema']}.outbox")
    processed = 0

    def observe(result: Result) -> None:
        nonlocal processed
        with open(spec["outcomes"], "a") as out:
            out.write(f"{result.message.id} {result.outcome.value}\n")
        if result.outcome is Outcome.PROCESSED:
            processed += 1
            if processed == spec.get("kill_after"):
                os.kill(os.getpid(), signal.SIGKILL)  # committed, not acked

    once = DedupMiddleware(AsyncDeduplicator(engine, "fs-kill", tables=tables, observers=[observe]))
    broker, router, source = _broker(spec, once)
    ledger = spec["ledger"]
    calls = 0

    @router.subscriber(*source["args"], **source["kwargs"])
    async def charge(body: Body, session: Annotated[AsyncSession, Context(SESSION)]) -> None:
        nonlocal calls
        await session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', :n, :r)"),
            {"n": body["amount"], "r": body["ref"]},
        )
        calls += 1
        if calls == spec.get("kill_in_handler"):
            await session.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # written, not committed

    broker.include_router(router)

    async def run() -> None:
        async with broker:
            await broker.start()
            with open(spec["outcomes"], "a") as out:
                out.write("started -\n")
            await asyncio.Event().wait()  # until the test kills or terminates this process

    asyncio.run(run())


def _broker(spec: dict[str, Any], once: DedupMiddleware) -> tuple[Any, Any, dict[str, Any]]:
    if spec["broker"] == "rabbit":
        from faststream.rabbit import RabbitBroker, RabbitRouter

        return (
            RabbitBroker(spec["url"], logger=None),
            RabbitRouter(middlewares=[once]),
            {"args": [spec["source"]], "kwargs": {}},
        )
    from faststream.kafka import KafkaBroker, KafkaRouter

    kwargs = {
        "group_id": spec["group"],
        "auto_offset_reset": "earliest",
        "ack_policy": AckPolicy.ACK,
        **spec.get("group_options", {}),
    }
    return (
        KafkaBroker(spec["url"], logger=None),
        KafkaRouter(middlewares=[once]),
        {"args": [spec["source"]], "kwargs": kwargs},
    )


if __name__ == "__main__":
    with open(sys.argv[1]) as given:
        main(json.load(given))
