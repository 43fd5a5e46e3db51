"""The publisher contract, one scenario per sentence, for every Publisher the project ships.

A broker's test module subclasses ``PublisherContract`` and provides a
``harness`` fixture: a small object that makes publishers and destinations
and reads back what a consumer would receive. Publishers are driven the way
the outbox relay drives them (``consumerdedup.outbox.sending.Sender``), so a
blocking and an asyncio publisher meet the same scenarios. What a broker does
differently it declares in ``PublisherCapabilities``; the suite then checks
that instead of skipping. The sentences are in consumerdedup/outbox/publisher.py.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import pytest
from sqlalchemy.orm import Session

from consumerdedup import (
    AsyncPublisher,
    BrokerUnavailable,
    DestinationMissing,
    Outbox,
    OutboxRelay,
    Publisher,
)
from consumerdedup.headers import ID_HEADER
from consumerdedup.outbox.publisher import Outgoing
from consumerdedup.outbox.sending import Sender
from consumerdedup.retry import ErrorKind, classify
from tests.conftest import Database


@dataclass(frozen=True)
class PublisherCapabilities:
    creates_destinations: bool = False
    """A publish to a destination that does not exist creates it (the MemoryBroker's queues)
    instead of raising DestinationMissing."""
    can_be_away: bool = True
    """The broker lives across a network and can be unreachable; an in-process one cannot."""


@dataclass(frozen=True)
class Received:
    """One message as a consumer of the destination reads it."""

    id: str | None
    """The id a consumer takes: the broker's own message-id field where it has one."""
    body: bytes
    headers: Mapping[str, str]


class PublisherHarness(Protocol):
    capabilities: PublisherCapabilities

    def publisher(self) -> Publisher | AsyncPublisher:
        """A new publisher to the broker."""

    def unreachable(self) -> Publisher | AsyncPublisher:
        """A publisher to a broker that does not answer (``can_be_away`` only)."""

    def destination(self) -> str:
        """A destination that exists and is empty."""

    def missing(self) -> str:
        """The name of a destination that does not exist."""

    def received(self, destination: str) -> list[Received]:
        """What a consumer of ``destination`` reads now, in the broker's order."""


@contextmanager
def sending(publisher: Publisher | AsyncPublisher) -> Iterator[Sender]:
    sender = Sender(publisher)
    try:
        yield sender
    finally:
        sender.close()


def headers(event_id: str, **more: str) -> dict[str, str]:
    return {ID_HEADER: event_id, **more}


class PublisherContract:
    """Subclass and provide a ``harness`` fixture to run the contract on a broker."""

    def test_publish_returns_once_the_broker_has_the_message(
        self, harness: PublisherHarness
    ) -> None:
        destination = harness.destination()
        with sending(harness.publisher()) as sender:
            sender.publish(destination, b"first", "k", headers("e-1"))
            assert [r.body for r in harness.received(destination)] == [b"first"]
            sender.publish(destination, b"second", None, headers("e-2"))
            assert sorted(r.body for r in harness.received(destination)) == [b"first", b"second"]

    def test_the_message_keeps_its_body_and_headers_and_its_event_id_is_its_id(
        self, harness: PublisherHarness
    ) -> None:
        destination = harness.destination()
        body = bytes(range(256))
        with sending(harness.publisher()) as sender:
            sender.publish(destination, body, "k", headers("e-1", trace="t-1"))
        [received] = harness.received(destination)
        assert received.body == body
        assert received.headers == {ID_HEADER: "e-1", "trace": "t-1"}
        assert received.id == "e-1"

    def test_messages_with_one_key_arrive_in_publish_order(self, harness: PublisherHarness) -> None:
        destination = harness.destination()
        with sending(harness.publisher()) as sender:
            for n in range(30):
                key = ("a", "b", "c")[n % 3]
                sender.publish(destination, f"{key}:{n}".encode(), key, headers(f"e-{n}"))
        bodies = [r.body.decode().split(":") for r in harness.received(destination)]
        for key in ("a", "b", "c"):
            sequence = [int(n) for k, n in bodies if k == key]
            assert sequence == list(range(("a", "b", "c").index(key), 30, 3))

    def test_a_window_gives_one_outcome_per_message_in_order_and_keeps_key_order(
        self, harness: PublisherHarness
    ) -> None:
        """What the relay hands over at a time (pipelined, or one publish each): a missing
        destination mid-window is that message's outcome; the other messages arrive, each
        key's in window order."""
        destination, missing = harness.destination(), harness.missing()
        window = [
            Outgoing(destination, f"{'abc'[n % 3]}:{n}".encode(), "abc"[n % 3], headers(f"e-{n}"))
            for n in range(30)
        ]
        window[10] = Outgoing(missing, b"lost", "z", headers("e-missing"))
        with sending(harness.publisher()) as sender:
            outcomes = sender.publish_window(window)
        assert len(outcomes) == 30
        if harness.capabilities.creates_destinations:
            assert outcomes[10] is None
        else:
            assert isinstance(outcomes[10], DestinationMissing), outcomes[10]
        assert [n for n, o in enumerate(outcomes) if o is not None and n != 10] == []
        bodies = [r.body.decode().split(":") for r in harness.received(destination)]
        for key in "abc":
            sequence = [int(n) for k, n in bodies if k == key]
            assert sequence == [n for n in range("abc".index(key), 30, 3) if n != 10]

    def test_a_broker_away_is_broker_unavailable(self, harness: PublisherHarness) -> None:
        if not harness.capabilities.can_be_away:
            return  # nothing stands between the relay and an in-process broker
        with sending(harness.unreachable()) as sender, pytest.raises(BrokerUnavailable) as caught:
            sender.publish(harness.missing(), b"x", "k", headers("e-1"))
        assert isinstance(caught.value, ConnectionError)
        assert not isinstance(caught.value, DestinationMissing)
        assert classify(caught.value) is ErrorKind.TRANSIENT

    def test_a_missing_destination_is_destination_missing_and_not_broker_unavailable(
        self, harness: PublisherHarness
    ) -> None:
        missing = harness.missing()
        with sending(harness.publisher()) as sender:
            if harness.capabilities.creates_destinations:
                sender.publish(missing, b"x", "k", headers("e-1"))
                assert [r.id for r in harness.received(missing)] == ["e-1"]
                return
            with pytest.raises(DestinationMissing) as caught:
                sender.publish(missing, b"x", "k", headers("e-1"))
            assert not isinstance(caught.value, ConnectionError)
            destination = harness.destination()  # the broker still answers for the others
            sender.publish(destination, b"y", "k", headers("e-2"))
        assert [r.id for r in harness.received(destination)] == ["e-2"]

    def test_a_closed_publisher_opens_again_on_its_next_publish(
        self, harness: PublisherHarness
    ) -> None:
        destination = harness.destination()
        publisher = harness.publisher()
        for n in range(2):  # each Sender enters the publisher's context and leaves it
            with sending(publisher) as sender:
                sender.publish(destination, b"x", None, headers(f"e-{n}"))
        with sending(publisher):
            pass  # entered and left without a publish: nothing to close, nothing raised
        assert sorted(r.id or "" for r in harness.received(destination)) == ["e-0", "e-1"]

    def test_the_relay_publishes_through_it_blocking_or_asyncio(
        self, harness: PublisherHarness, sqlite_db: Database
    ) -> None:
        destination = harness.destination()
        outbox = Outbox(sqlite_db.tables)
        with Session(sqlite_db.engine) as session, session.begin():
            ids = [outbox.add(session, destination, f"{n}".encode(), key="k") for n in range(5)]
        publisher: Any = harness.publisher()
        with OutboxRelay(sqlite_db.engine, publisher, tables=sqlite_db.tables) as relay:
            assert relay.drain() == 5
        assert [r.id for r in harness.received(destination)] == ids
