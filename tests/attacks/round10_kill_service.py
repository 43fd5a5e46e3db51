"""A service whose worker child is killed (SIGKILL, by itself) between a batch's COMMIT and
its ack, once: the first time message ``KILL_AT`` commits. Run by `consumerdedup run` in
test_round10_kill_between_commit_and_ack.py; names come from the environment."""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.orm import Session

from consumerdedup import App, Message, Result, Tables

SCHEMA = os.environ["ROUND10_SCHEMA"]
KILL_AT = os.environ["ROUND10_KILL_AT"]
MARK = Path(os.environ["ROUND10_MARK"])

app = App("kill", tables=Tables.define(f"{SCHEMA}.processed_events", f"{SCHEMA}.outbox"))


def die_once_after_commit(results: Sequence[Result]) -> None:
    if any(r.message.id == KILL_AT for r in results) and not MARK.exists():
        MARK.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)  # committed, not acked


@app.rabbitmq(
    queue=os.environ["ROUND10_QUEUE"],
    consumer="kill",
    batch_size=1,
    prefetch=1,
    before_ack=die_once_after_commit,
)
def apply(message: Message, session: Session) -> None:
    session.execute(
        text(f"INSERT INTO {SCHEMA}.ledger (message_id) VALUES (:id)"), {"id": message.id}
    )
