"""The ASGI middleware's held-back response: kept whole up to a limit, then streamed.

``HeldResponse`` is the app's ``send`` while an idempotent request runs: it
keeps every message until the response is complete (then the middleware
stores it and sends it), or until it grows past the route's
max_stored_body, something it cannot keep arrives (trailers), or a body
comes before its start. Then it marks itself ``overflowed`` and blocks the
app until the middleware has recorded the response as not stored
(``open_gate``), and from there passes everything straight to the client.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from datetime import timedelta
from typing import Any

from . import flow
from .exchange import LeaseWatch
from .stored import StoredResponse

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]
log = logging.getLogger("consumerdedup.http")


class HeldResponse:
    """The app's send: holds the response back up to ``limit`` bytes, then (past it, once the
    not-stored record is written) streams it."""

    def __init__(self, send: Send, limit: int) -> None:
        self.send = send
        self.limit = limit
        self.messages: list[Message] = []
        self.status: int | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.size = 0
        self.complete = False
        self.overflowed = asyncio.Event()
        self.completed = asyncio.Event()
        # Resolved once the response is decided (complete, or overflowed) or the app ended:
        # one future for the middleware to await, not a task per event.
        self.decided: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._trailers = False
        self._gate = asyncio.Event()
        self._passing = False

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages[1:])

    async def __call__(self, message: Message) -> None:
        if self._passing:
            await self.send(message)
            return
        self.messages.append(message)
        kind = message["type"]
        if kind == "http.response.start":
            self.status = int(message["status"])
            self.headers = list(message.get("headers", []))
            self._trailers = bool(message.get("trailers", False))
            return
        if kind == "http.response.body" and self.status is not None:
            self.size += len(message.get("body", b""))
            if self.size <= self.limit:
                self.complete = not message.get("more_body", False)
                if self.complete and not self._trailers:
                    # Decided now, not when the app returns: what it does after its response
                    # (a background task) must neither hold the response back nor undo it.
                    self.completed.set()
                    self.decide()
                return
        # Past the limit, or something we cannot keep (trailers, a body before its start):
        # wait until the not-stored record is written, then send all and pass through.
        self.overflowed.set()
        self.decide()
        await self._gate.wait()
        self._passing = True
        held, self.messages = self.messages, []
        for held_message in held:
            await self.send(held_message)

    def decide(self, _: object = None) -> None:
        if not self.decided.done():
            self.decided.set_result(None)

    def open_gate(self) -> None:
        self._gate.set()

    def result(self, task: asyncio.Future[None]) -> flow.RunResult:
        """What Run reports, once the response is decided; the app may still run."""
        if self.completed.is_set():  # the app may still run (work after its response)
            assert self.status is not None
            return flow.Finished(StoredResponse.capture(self.status, self.headers, self.body))
        if self.overflowed.is_set() and not task.done():
            assert self.status is not None
            return flow.Overflowed(self.status)
        error = task.exception()
        if error is not None or not self.complete or self.status is None:
            return flow.Crashed(error)
        return flow.Finished(StoredResponse.capture(self.status, self.headers, self.body))

    async def deliver(self, task: asyncio.Future[None]) -> None:
        """Send what the app produced (or re-raise its error), then let the app end."""
        if self.overflowed.is_set() and not task.done():
            self.open_gate()
            await task
            return
        if not self.completed.is_set():
            error = task.exception()
            if error is not None:
                raise error
        for message in self.messages:
            await self.send(message)
        # What the app does after its response (background tasks) ends here; an error
        # from it reaches the server after the response, as it would without us.
        await task


async def call(function: Callable[..., Any], *args: Any) -> Any:
    """A store method, awaited if it is async, else run in a worker thread."""
    if inspect.iscoroutinefunction(function):
        return await function(*args)
    return await asyncio.to_thread(function, *args)


async def renew_lease(
    store: Any, held: flow.Claim, token: str, lease: timedelta, watch: LeaseWatch
) -> None:
    """Renews ``held`` every third of its lease until cancelled or the claim is lost
    (the twin of wsgi_held.LeaseRenewer); ``watch`` is told how each renewal went."""
    every = lease.total_seconds() / 3
    while True:
        await asyncio.sleep(every)
        sent = watch.now()
        try:
            kept = await call(store.renew, held.scope, held.key, token, lease)
        except Exception:
            # One failed renewal (a dropped connection, a blip) must not end the renewing:
            # the next one may still hold the claim before its lease runs out.
            log.exception("idempotency lease renewal failed for %s", held.scope)
            continue
        watch.renewed(sent, bool(kept))
        if not kept:
            log.warning("idempotency claim lost %s: its lease ran out", held.scope)
            return


async def send_response(send: Send, response: StoredResponse, replayed: bool) -> None:
    headers = (
        response.replay_headers()
        if replayed
        else [(n.encode("latin-1"), v.encode("latin-1")) for n, v in response.headers]
    )
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    await send({"type": "http.response.body", "body": response.body, "more_body": False})
