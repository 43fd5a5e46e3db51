"""README promises of the RabbitMQ runner about RETRY pauses, heartbeats and order.

- RETRY: "the runner pauses (still answering heartbeats) for ``retry_delay``, doubling per
  consecutive RETRY of the same id up to ``max_retry_delay``, then nacks with requeue";
- Heartbeats: "a handler slower than twice the heartbeat gets its connection dropped by the
  broker (the message is redelivered, answered DUPLICATE if committed)";
- Order: "a retried message comes back after what was already prefetched (``prefetch=1``
  keeps strict order)".

All on the real broker and PostgreSQL. Each delivery the handler sees is recorded with the
time it arrived and its consumer tag: pika makes a new tag for every ``basic_consume``, so
one tag across attempts means one channel on one connection (no reconnect in between).

Heartbeat timing, measured on RabbitMQ 3.10 with ``heartbeat=1``: a client silent for 3.0 s
keeps its connection, one silent for 3.3 s has it reset (the broker checks once per
heartbeat interval and gives up after two silent checks, so between 2 and 3 intervals plus
a tick). The tests stay silent, or pause, for 4.5 s: well past that, in both directions.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text

from consumerdedup import Deduplicator, Message, Outcome, RetryLater, RetryPolicy
from consumerdedup.adapters.rabbitmq import RabbitConfig, RabbitConsumerRunner
from tests.conftest import Database
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401

QUICK = RetryPolicy(attempts=1, initial_delay=timedelta(0), max_delay=timedelta(0))
"""No in-process retry: a RetryLater is a RETRY at once, so the runner's pause is all there is."""
FAST = {
    "idle_timeout": timedelta(milliseconds=300),
    "reconnect_delay": timedelta(milliseconds=50),
    "max_reconnect_delay": timedelta(milliseconds=200),
}
SILENCE = 4.5
"""Seconds without a heartbeat answered: the broker (heartbeat=1) drops a client after ~3.3."""


@dataclass(frozen=True)
class Attempt:
    id: str
    at: float  # time.monotonic() when the handler got it
    consumer_tag: str
    redelivered: bool


class Consumer:
    """A runner over PostgreSQL whose handler writes one ledger row per message.

    ``retries[id]``: the first that many deliveries of ``id`` raise RetryLater.
    ``slow[id]``: the first delivery of ``id`` writes its row, then sleeps that long
    (blocking the runner's thread, so pika answers no heartbeat), then commits.
    """

    def __init__(
        self,
        db: Database,
        rabbit: Broker,
        queue: str,
        *,
        retries: dict[str, int] | None = None,
        slow: dict[str, float] | None = None,
        **config: Any,
    ) -> None:
        self.db = db
        self.ledger = db.create_ledger()
        self.attempts: list[Attempt] = []
        self.results: list[tuple[str, Outcome]] = []  # every Result, as the runner settles it
        retries, slow = retries or {}, slow or {}
        dedup = Deduplicator(db.engine, consumer="ledger", tables=db.tables, retry=QUICK)

        @dedup.handler
        def handle(message: Message, session: Any) -> None:
            mid = str(message.id)
            method = message.raw.method
            self.attempts.append(
                Attempt(mid, time.monotonic(), method.consumer_tag, method.redelivered)
            )
            tries = sum(attempt.id == mid for attempt in self.attempts)
            if tries <= retries.get(mid, 0):
                raise RetryLater("not yet")
            session.execute(
                text(
                    f"INSERT INTO {self.ledger} (account, amount, message_id) VALUES ('a', 1, :m)"
                ),
                {"m": mid},
            )
            if tries == 1 and mid in slow:
                time.sleep(slow[mid])

        def settled(results: Any) -> None:
            self.results.extend((str(result.message.id), result.outcome) for result in results)

        self.runner = RabbitConsumerRunner(
            handle,
            queue,
            url=rabbit.url,
            config=RabbitConfig(**{**FAST, **config}),
            before_ack=settled,
        )

    def handled(self) -> list[str]:
        return [attempt.id for attempt in self.attempts]

    def gaps(self, mid: str) -> list[float]:
        """Seconds between one delivery of ``mid`` reaching the handler and the next."""
        times = [attempt.at for attempt in self.attempts if attempt.id == mid]
        return [later - earlier for earlier, later in itertools.pairwise(times)]

    def applied(self) -> list[str]:
        with self.db.engine.connect() as conn:
            return [r[0] for r in conn.exec_driver_sql(f"SELECT message_id FROM {self.ledger}")]

    def recorded(self) -> list[str]:
        table = self.db.name("processed_events")
        with self.db.engine.connect() as conn:
            return [r[0] for r in conn.exec_driver_sql(f"SELECT message_id FROM {table}")]


def body(**data: Any) -> bytes:
    return json.dumps(data).encode()


# --- RETRY: the pause doubles per consecutive RETRY, up to max_retry_delay ---------------------


def test_the_retry_pause_doubles_per_consecutive_retry_and_is_capped_at_max_retry_delay(
    pg: Database, rabbit: Broker
) -> None:
    queue = rabbit.queue()
    rabbit.publish(queue, body(n=1), "m-1")
    consumer = Consumer(
        pg,
        rabbit,
        queue,
        retries={"m-1": 6},
        prefetch=1,  # only m-1 goes round: each gap is one pause plus one nack and redelivery
        batch_size=1,
        retry_delay=timedelta(milliseconds=50),
        max_retry_delay=timedelta(milliseconds=200),
    )
    consumer.runner.run(until_idle=True)

    pauses = [0.05, 0.1, 0.2, 0.2, 0.2, 0.2]  # doubled, then capped; no jitter on redeliveries
    gaps = consumer.gaps("m-1")
    assert len(gaps) == len(pauses), consumer.handled()
    # Lower bounds are exact: the handler's clock brackets the whole pause, which runs to
    # its deadline, so a pause that did not double (0.05 each time) fails here.
    assert all(gap >= pause for gap, pause in zip(gaps, pauses, strict=True)), gaps
    # Upper bounds: the pause plus 0.3 s for the nack, the redelivery and the handler's
    # BEGIN/ROLLBACK (a few ms here; generous for a loaded machine). Without the cap the
    # pauses would go on 0.4, 0.8, 1.6 s: the fifth gap alone is past 0.2 + 0.3.
    assert all(gap < pause + 0.3 for gap, pause in zip(gaps, pauses, strict=True)), gaps

    assert consumer.runner.outcomes == {Outcome.RETRY: 6, Outcome.PROCESSED: 1}
    assert consumer.runner.reconnects == 0
    assert consumer.applied() == ["m-1"] and consumer.recorded() == ["m-1"]
    assert rabbit.held(queue) == 0


def test_the_retry_pause_answers_heartbeats_so_the_broker_keeps_the_connection(
    pg: Database, rabbit: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    queue = rabbit.queue()
    rabbit.publish(queue, body(n=1), "m-1")
    consumer = Consumer(
        pg,
        rabbit,
        queue,
        retries={"m-1": 1},
        retry_delay=timedelta(seconds=SILENCE),  # 4.5 heartbeat intervals
        max_retry_delay=timedelta(seconds=SILENCE),
        connection_options={"heartbeat": 1},
    )
    with caplog.at_level("WARNING", logger="consumerdedup.rabbitmq"):
        consumer.runner.run(until_idle=True)

    [gap] = consumer.gaps("m-1")
    assert gap >= SILENCE  # the pause did last long enough to cost a silent client its link
    # The connection survived the pause: no reconnect, and the retried delivery came back
    # to the same consumer (pika makes a new tag for every basic_consume).
    assert consumer.runner.reconnects == 0
    assert "lost its RabbitMQ connection" not in caplog.text
    first, second = consumer.attempts
    assert second.consumer_tag == first.consumer_tag
    assert second.redelivered  # nacked with requeue, not published again
    # Then processed exactly once.
    assert consumer.results == [("m-1", Outcome.RETRY), ("m-1", Outcome.PROCESSED)]
    assert consumer.applied() == ["m-1"] and consumer.recorded() == ["m-1"]
    assert rabbit.held(queue) == 0


# --- Heartbeats: a handler slower than the broker's patience loses the connection ----------------


def test_a_handler_slower_than_the_heartbeat_loses_the_connection_and_its_redelivery_is_duplicate(
    pg: Database, rabbit: Broker
) -> None:
    queue = rabbit.queue()
    rabbit.publish(queue, body(n=1), "m-1")
    rabbit.publish(queue, body(n=2), "m-2")
    consumer = Consumer(
        pg,
        rabbit,
        queue,
        slow={"m-1": SILENCE},  # writes its row, then blocks the runner (and pika) for 4.5 s
        batch_size=1,
        connection_options={"heartbeat": 1},
    )
    consumer.runner.run(until_idle=True)

    # The handler ran to the end and its work committed (the commit comes before the ack);
    # the ack found the connection reset by the broker; the runner reconnected, m-1 came back
    # and was answered DUPLICATE without running the handler again, then m-2 went through.
    assert consumer.runner.reconnects == 1
    assert consumer.results == [
        ("m-1", Outcome.PROCESSED),
        ("m-1", Outcome.DUPLICATE),
        ("m-2", Outcome.PROCESSED),
    ]
    assert consumer.handled() == ["m-1", "m-2"]  # a DUPLICATE is answered by the claim alone
    assert sorted(consumer.applied()) == ["m-1", "m-2"]
    assert sorted(consumer.recorded()) == ["m-1", "m-2"]
    assert rabbit.held(queue) == 0


# --- Order: a retried message comes back after what was already prefetched -------------------


@pytest.mark.parametrize(
    ("prefetch", "order"),
    [
        (10, ["m-1", "m-2", "m-3", "m-4", "m-5", "m-1"]),  # m-2..m-5 were already here
        (1, ["m-1", "m-1", "m-2", "m-3", "m-4", "m-5"]),  # strict order
    ],
)
def test_a_retried_message_comes_back_after_what_was_prefetched(
    pg: Database, rabbit: Broker, prefetch: int, order: list[str]
) -> None:
    queue = rabbit.queue()
    ids = [f"m-{i}" for i in range(1, 6)]
    for mid in ids:
        rabbit.publish(queue, body(n=1), mid)
    consumer = Consumer(
        pg,
        rabbit,
        queue,
        retries={"m-1": 1},
        prefetch=prefetch,
        batch_size=1,
        # The broker hands out the prefetched deliveries right after basic_consume; the
        # 0.1 s pause before m-1's nack leaves them more than enough time to be here first.
        retry_delay=timedelta(milliseconds=100),
    )
    consumer.runner.run(until_idle=True)

    assert consumer.handled() == order
    assert consumer.runner.outcomes == {Outcome.RETRY: 1, Outcome.PROCESSED: 5}
    assert sorted(consumer.applied()) == ids and sorted(consumer.recorded()) == ids
    assert rabbit.held(queue) == 0
