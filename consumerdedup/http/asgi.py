"""``IdempotencyMiddleware(app, engine)``: the idempotency-key algorithm as pure ASGI.

No framework needed (Starlette, FastAPI and a bare ASGI callable all work).
It drives flow.decide: reads the request body whole (to fingerprint it and
hand it to the app again), claims the key, runs the app with its response
held back, stores the response, and only then sends it. A response longer
than the route's max_stored_body (or streamed past it) is recorded as not
stored before its first byte leaves, then streamed: a retry gets a 409
problem, never a second run. In transactional mode the app finds the
request's Session (or AsyncSession) at ``scope["consumerdedup.session"]``
(see consumerdedup.http.fastapi for a dependency), and its writes commit
with the stored response before the response is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from ..errors import ConfigurationError
from ..schema import DEFAULT, Tables
from . import flow
from .asgi_held import HeldResponse, send_response
from .policy import IdempotencyPolicy, RoutePolicy
from .sql_statements import is_lock_timeout
from .sql_store import AsyncSqlStore, ClaimLost, SqlStore
from .store import Claimed, ClaimResult, InFlight
from .stored import StoredResponse
from .transactional import hold_commits

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Principal = Callable[[Mapping[str, Any]], "str | int | None"]

SESSION_KEY = "consumerdedup.session"
"""Where a transactional endpoint finds the request's Session in the ASGI scope."""
log = logging.getLogger("consumerdedup.http")
# A response held back must reach the client as the app sent it, not through a file handle.
_DIRECT_SENDS = ("http.response.pathsend", "http.response.zerocopysend")


class IdempotencyMiddleware:
    """Idempotency keys for an ASGI app; ``engine`` (Engine or AsyncEngine) holds the records.

    ``store``: another IdempotencyStore (e.g. Redis) for non-transactional routes;
    ``policy``: the routes and defaults (IdempotencyPolicy); ``routes``: the
    app's routes (``app.routes``), whose ``@idempotent`` marks join the policy
    at the first request; ``principal(scope)``: who is calling (user, API key,
    tenant), part of every key's scope; ``session_factory``: makes the
    transactional Session (default: ``Session(engine)`` / ``AsyncSession(engine)``).
    """

    def __init__(
        self,
        app: ASGIApp,
        engine: Engine | AsyncEngine | None = None,
        *,
        store: Any = None,
        policy: IdempotencyPolicy | None = None,
        routes: Iterable[object] = (),
        principal: Principal | None = None,
        tables: Tables = DEFAULT,
        session_factory: Callable[[], Session | AsyncSession] | None = None,
    ) -> None:
        self.app = app
        self.engine = engine
        self.sql_store: SqlStore | AsyncSqlStore | None = None
        if isinstance(engine, AsyncEngine):
            self.sql_store = AsyncSqlStore(engine, tables)
        elif isinstance(engine, Engine):
            self.sql_store = SqlStore(engine, tables)
        elif engine is not None:
            raise ConfigurationError(f"IdempotencyMiddleware: {engine!r} is not an engine")
        if store is None and self.sql_store is None:
            raise ConfigurationError("IdempotencyMiddleware needs an engine or a store")
        self.store: Any = store if store is not None else self.sql_store
        for name in ("claim", "renew", "complete", "release"):
            if not callable(getattr(self.store, name, None)):
                raise ConfigurationError(f"IdempotencyMiddleware: the store has no {name}()")
        self._base = policy if policy is not None else IdempotencyPolicy()
        self._routes = routes
        self._policy: IdempotencyPolicy | None = None
        self.principal = principal
        self.session_factory = session_factory
        # Over an AsyncEngine a twin may wait on the row lock (no thread is held meanwhile);
        # over a blocking one it would hold one of asyncio's few worker threads, which the
        # first request needs to commit: the twin polls instead (flow.decide's lock_waits).
        self.lock_waits = isinstance(engine, AsyncEngine)

    @property
    def policy(self) -> IdempotencyPolicy:
        """The policy with the routes' marks; resolved once, at the first request."""
        if self._policy is None:
            self._policy = self._base.for_middleware(
                self._routes,
                has_engine=self.sql_store is not None,
                middleware="IdempotencyMiddleware",
            )
        return self._policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = tuple(
            (n.decode("latin-1").lower(), v.decode("latin-1")) for n, v in scope["headers"]
        )
        principal = self.principal(scope) if self.principal is not None else None
        incoming = flow.Incoming(
            scope["method"], scope["path"], scope.get("query_string", b""), headers, principal
        )
        steps = flow.decide(incoming, self.policy, lock_waits=self.lock_waits)
        await _Exchange(self, scope, receive, send).drive(steps)


def _complete_sync(
    store: SqlStore,
    session: Session,
    allow: Callable[[], None],
    scope: str,
    key: str,
    token: str,
    response: StoredResponse,
    expiry: timedelta,
) -> None:
    store.complete_in(session, scope, key, response, expiry, token)
    allow()
    session.commit()


async def _call(function: Callable[..., Any], *args: Any) -> Any:
    """A store method, awaited if it is async, else run in a worker thread."""
    if inspect.iscoroutinefunction(function):
        return await function(*args)
    return await asyncio.to_thread(function, *args)


class _Exchange:
    """One request through the middleware: carries out flow's operations."""

    def __init__(self, owner: IdempotencyMiddleware, scope: Scope, receive: Receive, send: Send):
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
        self.allow_commit: Callable[[], None] | None = None

    async def drive(self, steps: Any) -> None:
        reply: Any = None
        try:
            while True:
                try:
                    operation = steps.send(reply)
                except StopIteration as stop:
                    decision = stop.value
                    break
                reply = await self.carry_out(operation)
            await self.finish(decision)
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
        if not claim.policy.transactional:
            try:
                result: ClaimResult = await _call(self.owner.store.claim, *args, claim.policy.lease)
            except ConfigurationError:
                raise  # a setup fault stays loud (500), never passed off as an outage
            except Exception:
                log.exception("idempotency store failed to claim for %s", claim.scope)
                return flow.StoreFailed()
        else:
            store = self.owner.sql_store
            assert store is not None  # the policy property refused transactional without it
            self.session = self.new_session()
            try:
                wait = claim.policy.wait if self.owner.lock_waits else timedelta(0)
                lease = claim.policy.lease
                result = await _call(store.claim_in, self.session, *args, wait, lease)
            except Exception as error:
                if isinstance(error, ConfigurationError):
                    await self.close_session()
                    raise
                if not is_lock_timeout(error):
                    log.exception("idempotency store failed to claim for %s", claim.scope)
                    await self.close_session()
                    return flow.StoreFailed()
                if store.engine.dialect.name == "sqlite":
                    # SQLite serialises writers: BEGIN IMMEDIATE timed out on the database's
                    # write lock, held by a twin or by any other transactional request.
                    log.info("idempotency store busy for %s: SQLite's write lock", claim.scope)
                    await self.close_session()
                    return flow.StoreBusy()
                result = InFlight(1.0)
            if not isinstance(result, Claimed):
                await self.close_session()
        if isinstance(result, Claimed):
            self.held = claim
        return result

    def new_session(self) -> Session | AsyncSession:
        if self.owner.session_factory is not None:
            return self.owner.session_factory()
        engine = self.owner.engine
        if isinstance(engine, AsyncEngine):
            return AsyncSession(engine, expire_on_commit=False)
        return Session(engine, expire_on_commit=False)

    async def run(self, policy: RoutePolicy) -> flow.RunResult:
        scope = {**self.scope}
        extensions = {
            k: v for k, v in scope.get("extensions", {}).items() if k not in _DIRECT_SENDS
        }
        scope["extensions"] = extensions
        if self.session is not None:
            scope[SESSION_KEY] = self.session
            self.allow_commit = hold_commits(self.session)
        self.capture = capture = HeldResponse(self.send, policy.max_stored_body)
        self.app_task = task = asyncio.ensure_future(self.owner.app(scope, self.replay, capture))
        renewing = None if policy.transactional else asyncio.ensure_future(self.renew(policy))
        task.add_done_callback(capture.decide)
        try:
            await asyncio.shield(capture.decided)
        finally:
            if renewing is not None:  # the claim ends now: stored, not stored, or released
                renewing.cancel()
        if capture.completed.is_set():  # the app may still run (work after its response)
            assert capture.status is not None
            body = capture.body
            return flow.Finished(StoredResponse.capture(capture.status, capture.headers, body))
        if capture.overflowed.is_set() and not task.done():
            assert capture.status is not None
            return flow.Overflowed(capture.status)
        error = task.exception()
        if error is not None or not capture.complete or capture.status is None:
            return flow.Crashed(error)
        return flow.Finished(StoredResponse.capture(capture.status, capture.headers, capture.body))

    async def replay(self) -> Message:
        """The app's receive: the body we read, then whatever the client does next."""
        if self.body is not None:
            body, self.body = self.body, None  # type: ignore[assignment]
            return {"type": "http.request", "body": body, "more_body": False}
        return await self.receive()

    async def renew(self, policy: RoutePolicy) -> None:
        assert self.held is not None
        every = policy.lease.total_seconds() / 3
        while True:
            await asyncio.sleep(every)
            held = self.held
            try:
                kept = await _call(
                    self.owner.store.renew, held.scope, held.key, self.token, policy.lease
                )
            except Exception:
                # One failed renewal (a dropped connection, a blip) must not end the renewing:
                # the next one may still hold the claim before its lease runs out.
                log.exception("idempotency lease renewal failed for %s", held.scope)
                continue
            if not kept:
                log.warning("idempotency claim lost %s: its lease ran out", held.scope)
                return

    async def complete(
        self, scope: str, key: str, token: str, response: StoredResponse, expiry: Any
    ) -> bool | flow.ClaimLost:
        assert self.held is not None
        if not self.held.policy.transactional:
            try:
                done = bool(
                    await _call(self.owner.store.complete, scope, key, token, response, expiry)
                )
            except Exception:
                # The endpoint's effects are done: answer; the claim lapses with its lease.
                log.exception("idempotency response could not be stored for %s", scope)
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
                    _complete_sync, store, session, allow, scope, key, token, response, expiry
                )
        except ClaimLost:
            log.error(
                "idempotency claim lost %s: the endpoint rolled back the request's "
                "transaction; nothing stored or committed",
                scope,
            )
            await self.close_session()
            self.held = None
            return flow.ClaimLost()
        except Exception:
            log.exception("idempotency commit failed for %s", scope)
            await self.close_session()
            self.held = None
            return False
        self.held = None
        return True

    async def release(self, scope: str, key: str, token: str) -> None:
        held, self.held = self.held, None
        if held is not None and held.policy.transactional:
            await self.close_session()  # rolls the endpoint's writes and the claim back
        else:
            await _call(self.owner.store.release, scope, key, token)

    async def finish(self, decision: flow.Decision) -> None:
        if isinstance(decision, flow.PassThrough):
            await self.owner.app(self.scope, self.receive, self.send)
        elif isinstance(decision, flow.Respond):
            await send_response(self.send, decision.response, decision.replayed)
            if self.app_task is not None:
                await self.app_task  # a run whose commit failed: let its after-work end
        else:
            assert self.capture is not None and self.app_task is not None
            if self.capture.overflowed.is_set() and not self.app_task.done():
                self.capture.open_gate()
                await self.app_task
                return
            if not self.capture.completed.is_set():
                error = self.app_task.exception()
                if error is not None:
                    raise error
            for message in self.capture.messages:
                await self.send(message)
            # What the app does after its response (background tasks) ends here; an error
            # from it reaches the server after the response, as it would without us.
            await self.app_task

    async def abandon(self) -> None:
        """Cancelled or failed mid-way: never leave a claim behind (the retry runs afresh)."""
        if self.app_task is not None and not self.app_task.done():
            self.app_task.cancel()
        held, self.held = self.held, None
        if held is None:
            return
        with contextlib.suppress(Exception):
            if held.policy.transactional:
                await self.close_session()
            else:
                await _call(self.owner.store.release, held.scope, held.key, self.token)

    async def close_session(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            with contextlib.suppress(Exception):
                await _call(session.close)


class _ClientGone(Exception):
    """The client disconnected before its request body arrived: nothing was claimed."""
