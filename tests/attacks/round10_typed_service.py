"""A service whose body model names a type its module never defines (a deploy that lost an
import). Run by `consumerdedup run` in test_round10_typed_bodies.py; the queue and the
tables' schema come from the environment."""

import os
from typing import Any

from pydantic import BaseModel

from consumerdedup import App, Tables

SCHEMA = os.environ["ROUND10_SCHEMA"]

app = App("typed", tables=Tables.define(f"{SCHEMA}.processed_events", f"{SCHEMA}.outbox"))


class Payment(BaseModel):
    account: "Account"  # type: ignore[name-defined]  # noqa: F821 - the lost import
    amount: int


@app.rabbitmq(queue=os.environ["ROUND10_QUEUE"], consumer="typed", batch_size=1, prefetch=1)
def take_payment(payment: Payment, session: Any) -> None:
    """Never reached: the model cannot validate anything."""
