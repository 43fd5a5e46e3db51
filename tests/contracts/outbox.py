"""The outbox relay over a real broker, end to end: the body the broker outbox tests share.

A broker's test module subclasses ``RelayToBrokerContract`` and provides a
``broker_side`` fixture: publishers to the broker, fresh destinations, what the
broker holds, and a deduplicating consumer downstream. Each scenario fills the
outbox on PostgreSQL, relays it and checks the events at the broker and after
the consumer: at least once on the broker, exactly once downstream, each key
in order.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any, Protocol

import pytest

from consumerdedup import (
    AsyncPublisher,
    OutboxRelay,
    Outcome,
    Publisher,
    RelayConfig,
    SimulatedCrash,
)
from consumerdedup.outbox.sending import Sender
from tests.support.outbox_events import Downstream, add_events, running

FAST = RelayConfig(batch_size=200, poll_interval=timedelta(seconds=0.2))
SHARED_KEYS = 500
"""Keys of the three-relay scenario: more than one round of FAST holds."""


class BrokerSide(Protocol):
    db: Any
    """The PostgreSQL database of the outbox and of the downstream consumer."""

    def publisher(self) -> Publisher | AsyncPublisher:
        """A new publisher to the broker."""

    def destination(self) -> str:
        """A fresh destination (of several partitions where the broker has them)."""

    def held(self, destination: str) -> list[tuple[str, int, str]]:
        """(key, seq, event_id) of each message the broker holds, in its order (per partition)."""

    def consume(self, destination: str, downstream: Downstream) -> Counter[Outcome]:
        """Every message held, once, through ``downstream.handler`` as a consumer would."""


def in_key_order(messages: Iterable[tuple[str, int, str]]) -> Mapping[str, list[int]]:
    per_key: dict[str, list[int]] = defaultdict(list)
    for key, seq, _ in messages:
        per_key[key].append(seq)
    for key, seqs in per_key.items():
        assert seqs == sorted(seqs), f"{key} out of order"
    return per_key


class DiesAfterConfirm(Publisher):
    """Publishes for real, and dies after the broker confirmed the ``after``-th message:
    a relay killed before it could mark its rows published."""

    def __init__(self, real: Publisher | AsyncPublisher, after: int) -> None:
        self.sender = Sender(real)
        self.after = after
        self.count = 0

    def publish(
        self,
        destination: str,
        body: bytes,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.sender.publish(destination, body, key, headers or {})  # the broker confirmed it
        self.count += 1
        if self.count == self.after:
            raise SimulatedCrash("relay killed before marking its rows published")

    def __exit__(self, *exc_info: object) -> None:
        self.sender.close()


class RelayToBrokerContract:
    """Subclass and provide a ``broker_side`` fixture to run the scenarios on a broker."""

    @pytest.mark.slow
    def test_ten_thousand_events_through_three_relays_each_applied_once_in_key_order(
        self, broker_side: BrokerSide
    ) -> None:
        db, destination = broker_side.db, broker_side.destination()
        # More keys than one round holds (a round's scan of batch_size rows covers about
        # 200 of them): with fewer, one relay locks every key at each round and the others
        # only get one when their claim falls into its gap between two rounds, which a
        # faster relay made rare ([10000, 0, 0] seen), so sharing rested on timing alone.
        ids = add_events(db, destination, 10_000, keys=SHARED_KEYS)
        relays = [
            OutboxRelay(db.engine, broker_side.publisher(), tables=db.tables, config=FAST)
            for _ in range(3)
        ]
        with running(relays):
            assert relays[0].wait_drained(300)
        # They shared the outbox: a relay takes a key whole; the others take the next keys.
        assert sum(r.published > 0 for r in relays) >= 2, [r.published for r in relays]
        # Several relays never publish a row twice while it is in flight (the README), and
        # nothing failed here: every event is at the broker exactly once.
        assert sum(r.published for r in relays) == len(ids)

        held = broker_side.held(destination)
        assert len(held) == len(ids)
        assert len(in_key_order(held)) == SHARED_KEYS
        downstream = Downstream(db)
        outcomes = broker_side.consume(destination, downstream)
        applied = downstream.applied()
        assert sorted(event_id for _, _, event_id in applied) == sorted(ids)  # each exactly once
        assert outcomes == Counter({Outcome.PROCESSED: len(ids)})  # and no duplicate to answer
        assert len(in_key_order(applied)) == SHARED_KEYS

    def test_a_relay_killed_after_the_confirm_publishes_again_and_downstream_answers_duplicate(
        self, broker_side: BrokerSide
    ) -> None:
        db, destination = broker_side.db, broker_side.destination()
        ids = add_events(db, destination, 6, keys=2)
        dying = DiesAfterConfirm(broker_side.publisher(), after=3)
        with (
            pytest.raises(SimulatedCrash),
            OutboxRelay(db.engine, dying, tables=db.tables, config=FAST) as relay,
        ):
            relay.run_once()
        assert len(broker_side.held(destination)) == 3
        with OutboxRelay(db.engine, broker_side.publisher(), tables=db.tables) as relay:
            assert relay.drain() == 6
        assert len(broker_side.held(destination)) == 9  # the first three went twice

        downstream = Downstream(db)
        outcomes = broker_side.consume(destination, downstream)
        assert sorted(event_id for _, _, event_id in downstream.applied()) == sorted(ids)
        assert outcomes == Counter({Outcome.PROCESSED: 6, Outcome.DUPLICATE: 3})
