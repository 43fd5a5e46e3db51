"""One request through the ASGI middleware: carries out flow's operations, awaited.

``Exchange.drive`` steps flow.decide and does each operation's I/O: reads the body,
claims (in the request's Session when transactional), runs the app with its response
held back (asgi_held.py), completes or releases, then sends what flow decided. What it
shares with the WSGI twin, without I/O, lives in exchange.py.

Past 250 lines on purpose: one class whose methods are the operations of flow.py, each
a few lines of I/O; read beside wsgi_exchange.py, method for method.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import replace
from datetime import timedelta
from typing import Any, Protocol

from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from . import exchange, flow
from .asgi_held import HeldResponse, call, renew_lease, send_response
from .policy import RoutePolicy
from .sql_store import AsyncSqlStore, ClaimLost, SqlStore
from .store import Claimed, ClaimResult
from .stored import StoredResponse
from .transactional import complete_and_commit, hold_commits

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class Owner(Protocol):
    """What an exchange reads of its middleware (asgi.IdempotencyMiddleware); a protocol,
    so that this module does not import the one that imports it."""

    @property
    def app(self) -> ASGIApp: ...
    @property
    def engine(self) -> Any: ...
    @property
    def store(self) -> Any: ...
    @property
    def sql_store(self) -> SqlStore | AsyncSqlStore | None: ...
    @property
    def session_factory(self) -> Any: ...
    @property
    def lock_waits(self) -> bool: ...


# A response held back must reach the client as the app sent it, not through a file handle.
_DIRECT_SENDS = ("http.response.pathsend", "http.response.zerocopysend")


class Exchange:
    """One request through the middleware: carries out flow's operations."""

    def __init__(self, owner: Owner, scope: Scope, receive: Receive, send: Send):
        self.owner = owner
        self.scope = scope
        self.receive = receive
        self.send = send
        self.body = b""
        self.session: Session | AsyncSession | None = None
        self.capture: HeldResponse | None = None
        self.app_task: asyncio.Future[None] | None = None
        self.held: flow.Claim | None = None
        self.token = ""
        self.claim_sent = 0.0
        self.allow_commit: Callable[[], None] | None = None

    async def drive(self, steps: Any) -> None:
        try:
            step = flow.advance(steps, None)
            while not isinstance(step, flow.Decision):
                step = flow.advance(steps, await self.carry_out(step))
            await self.finish(step)
        except _ClientGone:
            await asyncio.shield(self.abandon())
        except BaseException:
            await asyncio.shield(self.abandon())
            raise
        finally:
            await self.close_session()

    async def carry_out(self, operation: flow.Operation) -> Any:
        match operation:
            case flow.ReadBody(limit):
                return await self.read_body(limit)
            case flow.Claim():
                return await self.claim(operation)
            case flow.Pause(seconds):
                await asyncio.sleep(seconds)
                return None
            case flow.Run(token, policy):
                self.token = token
                return await self.run(policy)
            case flow.Complete(scope, key, token, response, expiry):
                return await self.complete(scope, key, token, response, expiry)
            case flow.Release(scope, key, token):
                await self.release(scope, key, token)
                return None
        raise AssertionError(f"unknown operation {operation!r}")

    async def read_body(self, limit: int) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                self.body = b"".join(chunks)
                return self.body

    async def claim(self, claim: flow.Claim) -> ClaimResult | flow.StoreFailed | flow.StoreBusy:
        args = (claim.scope, claim.key, claim.fingerprint)
        self.claim_sent = exchange.LeaseWatch.now()
        if not claim.policy.transactional:
            try:
                result: ClaimResult | flow.StoreFailed | flow.StoreBusy = await call(
                    self.owner.store.claim, *args, claim.policy.lease
                )
            except Exception as error:
                result = exchange.claim_failed(error, claim.scope)
        else:
            store = self.owner.sql_store
            assert store is not None  # the policy property refused transactional without it
            self.session = exchange.new_session(self.owner.session_factory, self.owner.engine)
            try:
                wait = claim.policy.wait if self.owner.lock_waits else timedelta(0)
                lease = claim.policy.lease
                result = await call(store.claim_in, self.session, *args, wait, lease)
            except Exception as error:
                await self.close_session()
                result = exchange.claim_in_failed(error, store.engine.dialect.name, claim.scope)
            if not isinstance(result, Claimed):
                await self.close_session()
        if isinstance(result, Claimed):
            self.held = claim
        return result

    async def run(self, policy: RoutePolicy) -> flow.RunResult:
        scope = {**self.scope}
        extensions = {
            k: v for k, v in scope.get("extensions", {}).items() if k not in _DIRECT_SENDS
        }
        scope["extensions"] = extensions
        if self.session is not None:
            scope[exchange.SESSION_KEY] = self.session
            self.allow_commit = hold_commits(self.session)
        self.capture = capture = HeldResponse(self.send, policy.max_stored_body)
        self.app_task = task = asyncio.ensure_future(self.owner.app(scope, self.replay, capture))
        renewing = watch = None
        if not policy.transactional:  # a transactional claim is its transaction: no lease
            assert self.held is not None
            watch = exchange.LeaseWatch(policy.lease, self.claim_sent)
            renewal = renew_lease(self.owner.store, self.held, self.token, policy.lease, watch)
            renewing = asyncio.ensure_future(renewal)
        task.add_done_callback(capture.decide)
        try:
            await asyncio.shield(capture.decided)
        finally:
            if renewing is not None:  # the claim ends now: stored, not stored, or released
                renewing.cancel()
        result = capture.result(task)
        return replace(result, lapsed=True) if watch is not None and watch.lapsed() else result

    async def replay(self) -> Message:
        """The app's receive: the body we read, then whatever the client does next."""
        if self.body is not None:
            body, self.body = self.body, None  # type: ignore[assignment]
            return {"type": "http.request", "body": body, "more_body": False}
        return await self.receive()

    async def complete(
        self, scope: str, key: str, token: str, response: StoredResponse, expiry: Any
    ) -> bool | flow.ClaimLost:
        assert self.held is not None
        if not self.held.policy.transactional:
            try:
                done = bool(
                    await call(self.owner.store.complete, scope, key, token, response, expiry)
                )
            except Exception:
                # The endpoint's effects are done: answer; the claim lapses with its lease.
                exchange.log.exception("idempotency response could not be stored for %s", scope)
                done = False
            self.held = None
            return done
        store, session, allow = self.owner.sql_store, self.session, self.allow_commit
        assert store is not None and session is not None and allow is not None
        try:
            if isinstance(store, AsyncSqlStore):
                assert isinstance(session, AsyncSession)

                def commit(sync: Session) -> None:  # in the same greenlet as the UPDATE
                    allow()
                    sync.commit()

                await store.complete_in(session, scope, key, response, expiry, token, commit)
            else:
                assert isinstance(session, Session)
                await asyncio.to_thread(
                    complete_and_commit, store, session, allow, scope, key, token, response, expiry
                )
        except ClaimLost:
            exchange.log_rolled_back(scope)
            await self.rolled_back()
            return flow.ClaimLost()
        except Exception:
            exchange.log.exception("idempotency commit failed for %s", scope)
            await self.rolled_back()
            return False
        self.held = None
        return True

    async def release(self, scope: str, key: str, token: str) -> None:
        if self.held is not None and self.held.policy.transactional:
            await self.rolled_back()  # rolls the endpoint's writes and the claim back
        else:
            self.held = None
            await call(self.owner.store.release, scope, key, token)

    async def finish(self, decision: flow.Decision) -> None:
        if isinstance(decision, flow.PassThrough):
            await self.owner.app(self.scope, self.receive, self.send)
        elif isinstance(decision, flow.Respond):
            await send_response(self.send, decision.response, decision.replayed)
            if self.app_task is not None:
                await self.app_task  # a run whose commit failed: let its after-work end
        else:
            assert self.capture is not None and self.app_task is not None
            await self.capture.deliver(self.app_task)

    async def abandon(self) -> None:
        """Cancelled or failed mid-way: never leave a claim behind (the retry runs afresh)."""
        if self.app_task is not None and not self.app_task.done():
            self.app_task.cancel()
        held = self.held
        if held is None:
            return
        if held.policy.transactional:
            await self.rolled_back()
            return
        self.held = None
        with contextlib.suppress(Exception):
            await call(self.owner.store.release, held.scope, held.key, self.token)

    async def rolled_back(self) -> None:
        """A transactional request that did not complete: roll it back, then make sure its
        claim was not committed by the endpoint itself (exchange.COMMITTED_BEHIND)."""
        held, self.held = self.held, None
        await self.close_session()
        store = self.owner.sql_store
        if held is None or store is None:
            return
        args = (held.scope, held.key, self.token, exchange.COMMITTED_BEHIND, held.policy.expiry)
        try:
            if await call(store.complete, *args):
                exchange.log_committed_behind(held.scope)
        except Exception:
            exchange.log.exception("idempotency claim could not be checked for %s", held.scope)

    async def close_session(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            with contextlib.suppress(Exception):
                await call(session.close)


class _ClientGone(Exception):
    """The client disconnected before its request body arrived: nothing was claimed."""
