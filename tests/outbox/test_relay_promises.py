"""Two promises of the README's outbox section, each against a running relay (``relay.run()``
in a thread), timed or cut the way production would see it.

1. "a failed publish is retried with exponential backoff ... and holds back only its key,
   the other keys go in the same round", with ``RelayConfig(initial_backoff, max_backoff)``:
   the waits between the attempts of one event double from ``initial_backoff`` and stop
   growing at ``max_backoff``; the event then goes exactly once and is marked; its key's
   later events wait behind it, other keys are not held up by its backoff. (That they go in
   the very round of the failure is tested with run_once in test_outbox.py.)
2. "a database that goes away is retried" and "at least once": PostgreSQL is cut off (a TCP
   proxy resets every connection mid-round, while the round claims, publishes or commits, and
   refuses new ones for a while) while the relay drains a backlog. The relay keeps running
   and, once the database is back, publishes every event at least once and marks it; only
   the round whose marks were lost goes twice.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from consumerdedup import Outbox, OutboxRelay, Publisher, RelayConfig
from consumerdedup.testing import MemoryBroker
from tests.conftest import Database
from tests.outbox.conftest import installed
from tests.support.outbox_events import add_events
from tests.support.tcp_proxy import Proxy

# -- 1. Backoff growth ------------------------------------------------------------------------

FIRST = 0.05  # initial_backoff, seconds
LONGEST = 0.3  # max_backoff: reached at the 4th wait (0.05, 0.1, 0.2, then 0.4 capped to 0.3)
FAILURES = 5  # a1 fails this many times, then goes: waits 0.05, 0.1, 0.2, 0.3, 0.3 (~1 s)
POLL = 0.02
BACKOFF = RelayConfig(
    batch_size=50,
    poll_interval=timedelta(seconds=POLL),
    max_attempts=10,  # > FAILURES: a1 is never parked
    initial_backoff=timedelta(seconds=FIRST),
    max_backoff=timedelta(seconds=LONGEST),
)
SLACK = 0.25
"""How much later than its backoff a retry may come. The relay stamps the failed row
``available_at = now + min(FIRST * 2**(n-1), LONGEST)`` after the n-th failure, with no jitter
(RelayConfig.backoff uses retry.Backoff(jitter=False); with jitter, retry.Backoff would add
at most FIRST more: uniform in [0, FIRST]). The relay then sees the row at its next round:
within POLL (the idle wait) plus one round of SQL. So each wait lies in
[backoff, backoff + FIRST + POLL + scheduling]; 0.25 s leaves ~0.18 s for a loaded 2-core box.
It stays below what a missing cap would give (the 5th wait would be 0.8 s > 0.3 + 0.25), and
the lower bound alone catches a backoff that does not grow (0.05 s where 0.1 s is due)."""

PROMPT = 0.15
"""How soon an event of another key leaves once committed while a1 backs off: the relay's
idle wait ends on the NOTIFY (PostgreSQL) or after POLL (SQLite), then one round (~0.03 s in
all). Were it held back behind a1, it would wait for a1's next try, up to 0.3 s away."""


def expected_wait(failures: int) -> float:
    """The README's exponential backoff: initial_backoff doubled per failure, capped."""
    return float(min(FIRST * 2 ** (failures - 1), LONGEST))


class Refusing(Publisher):
    """Refuses ``body`` a number of times (a broker that says no: each refusal is charged to
    the event), publishes everything else to a MemoryBroker; records every attempt."""

    def __init__(self, refusals: Mapping[str, int]) -> None:
        self.broker = MemoryBroker()
        self.refusals = dict(refusals)
        self.attempts: list[tuple[float, str, bool]] = []
        """(time.monotonic() at the call, body, published) for every publish call."""
        self.refused = threading.Condition()

    def publish(
        self,
        destination: str,
        body: bytes,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        name = body.decode()
        started = time.monotonic()
        if self.refusals.get(name, 0) > 0:
            self.refusals[name] -= 1
            with self.refused:
                self.attempts.append((started, name, False))
                self.refused.notify_all()
            raise ValueError(f"refused {name}")
        self.broker.publish(destination, body, key, headers)
        self.attempts.append((started, name, True))

    def wait_refused(self, name: str, times: int, timeout: float) -> bool:
        with self.refused:
            return self.refused.wait_for(
                lambda: sum(1 for _, n, ok in self.attempts if n == name and not ok) >= times,
                timeout,
            )


def add(db: Database, events: list[tuple[str, str | None]]) -> list[str]:
    outbox = Outbox(db.tables)
    with Session(db.engine) as session, session.begin():
        return [outbox.add(session, "orders", body.encode(), key=key) for body, key in events]


@pytest.fixture
def started() -> Iterator[list[tuple[OutboxRelay, threading.Thread, list[BaseException]]]]:
    """Relays started with ``start(relay)``; stopped, joined and checked at the end."""
    relays: list[tuple[OutboxRelay, threading.Thread, list[BaseException]]] = []
    yield relays
    for relay, thread, _ in relays:
        relay.stop()
        thread.join(20)
        assert not thread.is_alive()


def start(
    relays: list[tuple[OutboxRelay, threading.Thread, list[BaseException]]], relay: OutboxRelay
) -> tuple[threading.Thread, list[BaseException]]:
    """``relay.run()`` in a thread; whatever escapes run() lands in the returned list."""
    escaped: list[BaseException] = []

    def run() -> None:
        try:
            relay.run()
        except BaseException as exc:
            escaped.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    relays.append((relay, thread, escaped))
    thread.start()
    return thread, escaped


def test_a_failed_publish_backs_off_exponentially_up_to_max_backoff_and_holds_only_its_key(
    db: Database, started: Any
) -> None:
    ids = add(db, [("a1", "a"), ("b1", "b"), ("a2", "a"), ("b2", "b"), ("n1", None)])
    publisher = Refusing({"a1": FAILURES})
    relay = OutboxRelay(db.engine, publisher, tables=db.tables, config=BACKOFF)
    start(started, relay)
    # While a1 backs off (its 4th wait: 0.3 s), new events come: b3 must not wait, a3 must.
    assert publisher.wait_refused("a1", 4, timeout=10)
    ids += add(db, [("b3", "b"), ("a3", "a")])
    added = time.monotonic()
    deadline = time.monotonic() + 15
    while relay.backlog() > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert relay.backlog() == 0

    attempts = list(publisher.attempts)
    tries = [t for t, name, _ in attempts if name == "a1"]
    assert len(tries) == FAILURES + 1  # refused FAILURES times, then published
    waits = [later - earlier for earlier, later in itertools.pairwise(tries)]
    for n, wait in enumerate(waits, start=1):
        due = expected_wait(n)
        assert due <= wait <= due + SLACK, (n, due, [round(w, 3) for w in waits])
    # Doubling, then flat at the cap (each wait within its own bound above).
    assert [expected_wait(n) for n in range(1, FAILURES + 1)] == [0.05, 0.1, 0.2, 0.3, 0.3]

    # Published exactly once, marked, its failures on record, nothing parked.
    messages = publisher.broker.messages("orders")
    assert [m.body for m in messages].count(b"a1") == 1
    ob = db.tables.outbox
    with db.engine.connect() as conn:
        rows = {r.body: r for r in conn.execute(select(ob).order_by(ob.c.id))}
    assert rows[b"a1"].attempts == FAILURES
    assert rows[b"a1"].published_at is not None and rows[b"a1"].last_error is None
    assert all(r.published_at is not None for r in rows.values())
    assert relay.parked() == []
    assert sorted(m.id for m in messages) == sorted(ids)  # every event once, no more

    # Per key: a's events in the order added, none tried before a1 went; the other keys were
    # not held back by a1's backoff: b1, b2, n1 went before a1's first retry, and b3, added
    # while a1 waited, went within PROMPT of its commit rather than when a1 was due again.
    a1_sent = next(t for t, name, ok in attempts if name == "a1" and ok)
    assert [m.body for m in messages if m.body.startswith(b"a")] == [b"a1", b"a2", b"a3"]
    assert [m.body for m in messages if m.body.startswith(b"b")] == [b"b1", b"b2", b"b3"]
    assert all(t > a1_sent for t, name, _ in attempts if name in ("a2", "a3"))
    before_retry = [name for t, name, _ in attempts if t < tries[1]]
    assert sorted(before_retry) == ["a1", "b1", "b2", "n1"]
    b3_sent = next(t for t, name, _ in attempts if name == "b3")
    assert b3_sent - added < PROMPT, b3_sent - added
    assert b3_sent < a1_sent


# -- 2. The database cut off mid-round ---------------------------------------------------------

EVENTS = 500
KEYS = 10
BATCH = 50
OUTAGE = 1.5
"""Seconds the proxy refuses connections after cutting them."""
OUTAGE_CONFIG = RelayConfig(
    batch_size=BATCH,
    poll_interval=timedelta(milliseconds=50),
    initial_backoff=timedelta(milliseconds=50),
    max_backoff=timedelta(milliseconds=400),
)
"""After a failed round the relay waits 0.05, 0.1, 0.2, 0.4, 0.4 ... s, so it is back at most
~0.4 s after the proxy is: the whole test takes ~2.5 s; the 20 s deadline only stops a hang."""


class Counting(MemoryBroker):
    """A MemoryBroker that calls ``at_publish(n)`` before storing its n-th message."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.at_publish: Callable[[int], None] | None = None

    def publish(
        self,
        destination: str,
        body: bytes,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
        *,
        message_id: str | None = None,
    ) -> None:
        self.calls += 1
        if self.at_publish is not None:
            self.at_publish(self.calls)
        super().publish(destination, body, key, headers, message_id=message_id)


@pytest.fixture(params=["postgresql", "mariadb"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    yield from installed(request, request.param, tmp_path)


@pytest.fixture
def proxy(server: Database) -> Iterator[Proxy]:
    url = make_url(server.url)
    proxy = Proxy(
        url.host or "127.0.0.1", url.port or (5432 if server.dialect != "mysql" else 3306)
    )
    yield proxy
    proxy.cut()  # closes its listener and whatever is still connected


@pytest.fixture
def proxied(server: Database, proxy: Proxy) -> Iterator[Engine]:
    """An engine reaching the test's database through the proxy (the relay's, only)."""
    engine = create_engine(make_url(server.url).set(host="127.0.0.1", port=proxy.port))
    yield engine
    engine.dispose()


CLAIM_LOCK = {"postgresql": "pg_try_advisory_xact_lock", "mysql": "SKIP LOCKED"}
"""A statement of the claim that locks (the third round's is where ``claiming`` cuts)."""


@pytest.mark.postgres
@pytest.mark.parametrize("cut_at", ["claiming", "publishing", "committing"])
def test_database_cut_mid_round_relay_resumes_every_event_published_and_marked(
    server: Database,
    proxy: Proxy,
    proxied: Engine,
    started: Any,
    cut_at: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    pg = server
    caplog.set_level(logging.WARNING, logger="consumerdedup.relay")
    ids = add_events(pg, "orders", EVENTS, keys=KEYS)  # body "k<key>:<seq per key>"
    broker = Counting()
    relay = OutboxRelay(proxied, broker, tables=pg.tables, config=OUTAGE_CONFIG)
    observer = OutboxRelay(pg.engine, MemoryBroker(), tables=pg.tables, config=OUTAGE_CONFIG)
    cuts: list[float] = []
    back = threading.Timer(OUTAGE, proxy.restore)

    def cut() -> None:
        if not cuts:
            cuts.append(time.monotonic())
            proxy.cut()
            back.start()

    if cut_at == "claiming":
        # As the third round locks its keys: nothing of it published yet.
        locks: list[int] = []

        @event.listens_for(proxied, "before_cursor_execute")
        def before_lock(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            if CLAIM_LOCK[pg.dialect] in statement:
                locks.append(1)
                if len(locks) == 3:
                    cut()

    elif cut_at == "publishing":
        # In the third round, as it publishes its 25th row: the round's marks and commit fail.
        def at_publish(n: int) -> None:
            if n == 2 * BATCH + BATCH // 2:
                cut()

        broker.at_publish = at_publish
    else:
        # At the third round's COMMIT, every row of it published and marked, not committed.
        commits: list[int] = []

        @event.listens_for(proxied, "commit")
        def before_commit(conn: Any) -> None:
            commits.append(1)
            if len(commits) == 3:
                cut()

    thread, escaped = start(started, relay)
    try:
        deadline = time.monotonic() + 20
        while observer.backlog() > 0 and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        back.join(OUTAGE + 5)  # restored, even if the relay died

    assert cuts, "the proxy never cut the relay's connections"
    assert escaped == [] and thread.is_alive()  # the relay rode the outage out, did not crash
    assert "relay round failed" in caplog.text  # ... and it did see the database go away
    assert observer.backlog() == 0, "the relay never caught up after the database came back"
    assert observer.parked() == []
    with pg.engine.connect() as conn:
        ob = pg.tables.outbox.fullname
        unmarked, charged = conn.execute(
            text(
                "SELECT sum(CASE WHEN published_at IS NULL THEN 1 ELSE 0 END), max(attempts) "
                f"FROM {ob}"
            )
        ).one()
    assert unmarked == 0
    assert charged == 0  # no publish failed: the outage charged no event

    # At least once: every event out, and exactly the round whose marks were lost went twice
    # (a cut while claiming loses no mark; one while publishing or at COMMIT loses the whole
    # round's, all of it published: the broker, a MemoryBroker, was never cut).
    published = broker.messages("orders")
    sent = [m.id for m in published]
    assert set(sent) == set(ids)
    duplicates = len(sent) - len(set(sent))
    republished = {"claiming": 0, "publishing": BATCH, "committing": BATCH}[cut_at]
    assert duplicates == republished, f"{duplicates} events published twice, not {republished}"
    # Per key, deduplicated by event id downstream, in the order added.
    firsts: dict[str, list[int]] = {}
    seen: set[str] = set()
    for message in published:
        if message.id not in seen:
            seen.add(message.id)
            key, seq = message.body.decode().split(":")
            firsts.setdefault(key, []).append(int(seq))
    assert firsts == {f"k{k}": list(range(EVENTS // KEYS)) for k in range(KEYS)}
