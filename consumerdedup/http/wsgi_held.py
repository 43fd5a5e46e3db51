"""What the WSGI middleware holds while it decides: the response, and the lease.

HeldResponse is the app's ``start_response`` and body, kept back until the record is
stored; past ``limit`` bytes the rest stays in the app's iterator (StreamedRest sends it
after the not-stored record is written, and its close() reaches the app). LeaseRenewer
renews a claim from a thread of its own while the app runs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

from .exchange import LeaseWatch

log = logging.getLogger("consumerdedup.http")
READ_CHUNK = 64 * 1024


class LeaseRenewer:
    """Renews a claim every third of its lease until stop() (in a thread of its own)."""

    def __init__(
        self, store: Any, scope: str, key: str, token: str, lease: timedelta, watch: LeaseWatch
    ) -> None:
        self.store = store
        self.claim = (scope, key, token)
        self.lease = lease
        self.watch = watch  # told how each renewal went (read once stop() has joined)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.loop, name="idempotency-renew", daemon=True)
        self.thread.start()

    def loop(self) -> None:
        scope, key, token = self.claim
        while not self.stopped.wait(self.lease.total_seconds() / 3):
            sent = self.watch.now()
            try:
                kept = self.store.renew(scope, key, token, self.lease)
            except Exception:
                log.exception("idempotency lease renewal failed for %s", scope)
                continue
            self.watch.renewed(sent, bool(kept))
            if not kept:
                log.warning("idempotency claim lost %s: its lease ran out", scope)
                return

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()


class HeldResponse:
    """The app's response held back: status, headers, and body up to ``limit`` bytes; past
    it the rest stays in the app's iterator until the not-stored record is written."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.status_line: str | None = None
        self.headers: list[tuple[str, str]] = []
        self.exc_info: Any = None
        self.chunks: list[bytes] = []
        self.size = 0
        self.overflowed = False
        self.error: BaseException | None = None
        self.iterator: Iterator[bytes] | None = None
        self._result: Iterable[bytes] | None = None

    @property
    def status(self) -> int | None:
        return int(self.status_line.split(" ", 1)[0]) if self.status_line else None

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def start_response(
        self, status: str, headers: list[tuple[str, str]], exc_info: Any = None
    ) -> Callable[[bytes], object]:
        # Nothing has left yet, so a second call (with exc_info, PEP 3333) replaces the first.
        if self.status_line is not None and exc_info is None:
            raise AssertionError("start_response called twice without exc_info")
        self.status_line, self.headers, self.exc_info = status, list(headers), None
        return self.write

    def write(self, chunk: bytes) -> None:
        """The legacy write() callable: held back like the iterable's chunks."""
        self.add(chunk)

    def add(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self.size += len(chunk)
        if self.size > self.limit:
            self.overflowed = True

    def collect(self, result: Iterable[bytes]) -> None:
        self._result = result
        self.iterator = iter(result)
        for chunk in self.iterator:
            self.add(chunk)
            if self.overflowed:
                return  # the rest is sent after the not-stored record is written
        # Not closed here: close() is where an app does its work after the response (Flask's
        # call_on_close); it runs when the server closes what we return, after the response
        # was stored and sent, so an error there can neither undo it nor hold it back.

    def rest(self) -> Iterable[bytes]:
        """What the server sends: the chunks held, then (after an overflow) the app's rest;
        its close() reaches the app's."""
        return StreamedRest(self)

    def close(self) -> None:
        result, self._result = self._result, None
        close = getattr(result, "close", None)
        if close is not None:
            close()


class StreamedRest:
    """An overflowed response: held chunks, then the app's iterator; close() reaches the app."""

    def __init__(self, captured: HeldResponse) -> None:
        self.captured = captured

    def __iter__(self) -> Iterator[bytes]:
        yield from self.captured.chunks
        if self.captured.iterator is not None:
            yield from self.captured.iterator

    def close(self) -> None:
        self.captured.close()


def read_exactly(stream: Any, length: int) -> bytes:
    """Up to ``length`` bytes of ``stream``; fewer only if it ended first."""
    chunks: list[bytes] = []
    left = length
    while left > 0:
        chunk = stream.read(min(left, READ_CHUNK))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
