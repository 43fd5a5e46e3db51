"""A service whose deploy is broken (its handler reads a field the producer renamed):
every message fails with the same KeyError. Run by `consumerdedup run` in
test_round9_breaker.py; the queue and the tables' schema come from the environment."""

from __future__ import annotations

import json
import os
from typing import Any

from consumerdedup import App, RetryPolicy, Tables

SCHEMA = os.environ["BREAKER_SCHEMA"]
THRESHOLD = int(os.environ["BREAKER_THRESHOLD"])

app = App(
    "broken-deploy",
    tables=Tables.define(f"{SCHEMA}.processed_events", f"{SCHEMA}.outbox"),
)


@app.rabbitmq(
    queue=os.environ["BREAKER_QUEUE"],
    consumer=os.environ["BREAKER_CONSUMER"],
    batch_size=1,
    prefetch=1,
    retry=RetryPolicy(attempts=1, breaker_threshold=THRESHOLD),
)
def take_payment(message: Any, session: Any) -> None:
    json.loads(message.body)["amount_cents"]  # the producer renamed it to "amount"
