"""collector.freeze_once(): a full collection, then gc.freeze(), once a process."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from consumerdedup import collector


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process as if nothing had frozen it yet; unfrozen again afterwards."""
    gc.unfreeze()
    monkeypatch.setattr(collector, "_frozen", False)
    yield
    gc.unfreeze()
    gc.enable()


def test_it_collects_first_then_freezes_what_lives(fresh: None) -> None:
    garbage, kept = Node(), Node()
    gone = weakref.ref(garbage)
    del garbage  # unreachable now, but a cycle: still there until a collection
    assert gone() is not None
    assert collector.freeze_once()
    assert gone() is None  # freed, not frozen for good
    assert gc.get_freeze_count() > 0
    # What was alive is frozen, not lost: reference counting still frees it.
    assert kept.me is kept


def test_only_once_a_process(fresh: None) -> None:
    assert collector.freeze_once()
    frozen = gc.get_freeze_count()
    later = [Node() for _ in range(100)]
    assert not collector.freeze_once()
    assert gc.get_freeze_count() == frozen  # the objects made since are not frozen
    assert len(later) == 100


def test_not_when_the_process_manages_the_collector_itself(fresh: None) -> None:
    gc.disable()
    assert not collector.freeze_once()
    assert gc.get_freeze_count() == 0
    gc.enable()
    assert collector.freeze_once()  # it was not marked done
