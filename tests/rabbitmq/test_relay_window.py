"""The pipelined relay on the real RabbitMQ: a publish that fails in the middle of a window.

Real broker refusals: a queue full with ``x-overflow: reject-publish`` (the broker nacks),
a routing key no queue is bound to (``mandatory``: returned), an exchange that does not
exist (the broker closes the channel under the window); and a connection dropped mid-window
(a proxy cut while the window is on the wire). Each time, no later event of a failed key
is marked published in that round, the other keys' confirmed events are, and once the
broker takes everything again every event arrives, each queue holding every key's events
in order (repeats of an event come after its first copy: consumers dedup by event_id).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy import select
from sqlalchemy.orm import Session

from consumerdedup import Outbox, OutboxRelay, RelayConfig
from consumerdedup.adapters.rabbitmq import RabbitPublisher
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401
from tests.support.tcp_proxy import Proxy

NOW = RelayConfig(batch_size=100, initial_backoff=timedelta(0), max_backoff=timedelta(0))


def add(db: Any, events: list[tuple[str, str, str]]) -> dict[str, str]:
    """(destination, key, body) in this order; returns body: event_id."""
    outbox, ids = Outbox(db.tables), {}
    with Session(db.engine) as session, session.begin():
        for destination, key, body in events:
            ids[body] = outbox.add(session, destination, body.encode(), key=key)
    return ids


def published(db: Any) -> set[str]:
    ob = db.tables.outbox
    with db.engine.connect() as conn:
        rows = conn.execute(select(ob.c.body).where(ob.c.published_at.is_not(None)))
        return {row.body.decode() for row in rows}


def first_copies(rabbit: Broker, queue: str) -> list[str]:
    """The bodies ``queue`` holds, in its order, each event's repeats dropped (as a
    consumer deduplicating by message_id sees them)."""
    seen, bodies = set(), []
    for properties, body in rabbit.peek(queue):
        if properties.message_id not in seen:
            seen.add(properties.message_id)
            bodies.append(body.decode())
    return bodies


def in_key_order(bodies: list[str]) -> bool:
    """Bodies are ``<key><seq>``: per key, the seqs rise."""
    last: dict[str, int] = {}
    for body in bodies:
        key, seq = body[0], int(body[1:])
        if seq <= last.get(key, 0):
            return False
        last[key] = seq
    return True


def test_refusals_mid_window_hold_back_only_their_keys_and_nothing_is_lost(
    pg: Any, rabbit: Broker
) -> None:
    main = rabbit.queue("main", dead_letter=False)
    full = rabbit.queue("full", dead_letter=False)
    rabbit.channel.queue_delete(full)
    rabbit.channel.queue_declare(
        full, durable=True, arguments={"x-max-length": 1, "x-overflow": "reject-publish"}
    )
    rabbit.publish(full, b"filler")  # full now: the broker nacks the next publish
    exchange = rabbit.name("later")  # does not exist yet
    unbound = f"amq.direct/{rabbit.name('nobody')}"
    events = []
    for seq in range(1, 6):
        events.append((full if seq == 3 else main, "a", f"a{seq}"))  # a3 nacked
        events.append((unbound if seq == 2 else main, "b", f"b{seq}"))  # b2 returned
        events.append((f"{exchange}/x" if seq == 4 else main, "c", f"c{seq}"))  # c4: 404
        events.append((main, "d", f"d{seq}"))  # never fails
    add(pg, events)
    with OutboxRelay(pg.engine, RabbitPublisher(rabbit.url), tables=pg.tables, config=NOW) as relay:
        relay.run_once()
        assert published(pg) == {"a1", "a2", "b1", "c1", "c2", "c3"} | {
            f"d{seq}" for seq in range(1, 6)
        }
        # The broker takes everything now: room in the full queue, a queue bound to the
        # routing key, the exchange declared and bound.
        rabbit.channel.queue_purge(full)
        nobody = rabbit.queue("nobody", dead_letter=False)
        rabbit.channel.queue_bind(nobody, "amq.direct", unbound.split("/", 1)[1])
        rabbit.channel.exchange_declare(exchange, "direct")
        rabbit.channel.queue_bind(main, exchange, "x")
        assert relay.drain() == 20 - 11
    assert relay.backlog() == 0 and relay.parked() == []
    held = first_copies(rabbit, main)
    assert in_key_order(held), held
    everything = held + first_copies(rabbit, full) + first_copies(rabbit, nobody)
    assert sorted(everything) == sorted(body for _, _, body in events)


def test_a_connection_dropped_mid_window_marks_only_what_was_confirmed(
    pg: Any, rabbit: Broker, amqp_url: str
) -> None:
    """A cut while the window is on the wire: the unconfirmed events are not charged
    (the broker was away), the round ends, and the next one sends them again."""
    queue = rabbit.queue("dropped", dead_letter=False)
    target = urlsplit(amqp_url)
    proxy = Proxy(target.hostname or "127.0.0.1", target.port or 5672)
    proxied = amqp_url.replace(f":{target.port or 5672}/", f":{proxy.port}/")
    add(pg, [(queue, key, f"{key}{seq}") for seq in range(1, 41) for key in "abcde"])
    publisher = RabbitPublisher(proxied, attempts=1, connect_timeout=timedelta(seconds=2))
    sent = 0
    real = publisher._confirm_window

    def cut_mid_window() -> Any:
        window = real()
        channel = window.channel._impl  # the window publishes there, buffered
        publish = channel.basic_publish

        def basic_publish(*args: Any, **kwargs: Any) -> None:
            nonlocal sent
            sent += 1
            if sent == 60:  # in the middle of the first window of 100, 59 on the wire
                window.connection.process_data_events(time_limit=0)
                proxy.cut()
            publish(*args, **kwargs)

        channel.basic_publish = basic_publish
        return window

    publisher._confirm_window = cut_mid_window  # type: ignore[method-assign]
    with OutboxRelay(pg.engine, publisher, tables=pg.tables, config=NOW) as relay:
        first = relay.run_once()
        assert relay.broker_away and first < 60
        proxy.restore()
        assert relay.drain() == 200 - first
    proxy.cut()
    ob = pg.tables.outbox
    with pg.engine.connect() as conn:
        assert conn.execute(select(ob.c.attempts).where(ob.c.attempts > 0)).all() == []
    held = first_copies(rabbit, queue)
    assert in_key_order(held), held
    assert len(held) == 200
