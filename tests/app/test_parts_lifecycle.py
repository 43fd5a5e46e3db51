"""The relay's and the pruner's parts keep the lifecycle contract the runners keep: ready
once running, a tick while idle, stop() from any thread, not ready after."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from consumerdedup import App
from consumerdedup.app import Part, Settings
from consumerdedup.testing import MemoryBroker
from tests.conftest import Database
from tests.contracts.harness import until


@pytest.fixture
def parts(db: Database) -> list[Part]:
    app = App("svc", engine=db.engine, tables=db.tables)
    app.relay(to="kafka", poll_interval=timedelta(milliseconds=50))
    app.pruner(every=timedelta(hours=1), retention=timedelta(days=1))
    return app.build(Settings.load(), memory_broker=MemoryBroker())


@pytest.mark.parametrize("kind", ["relay", "pruner"])
def test_ready_ticking_and_stopped(parts: list[Part], kind: str) -> None:
    [part] = [p for p in parts if p.kind == kind]
    assert not part.ready
    running = threading.Thread(target=part.run)  # type: ignore[attr-defined]
    running.start()
    try:
        assert until(lambda: part.ready), f"the {kind} never became ready"
        first = part.last_tick
        assert until(lambda: part.last_tick > first, 10), f"the idle {kind} does not tick"
    finally:
        part.stop(deadline=10)
        running.join(30)
    assert not running.is_alive() and not part.ready


def test_a_part_stopped_before_it_runs_returns_at_once(parts: list[Part]) -> None:
    for part in parts:
        part.stop()
        part.run()  # type: ignore[attr-defined]
        assert not part.ready
