"""One request through the WSGI middleware: carries out flow's operations, blocking.

The twin of asgi_exchange.py: ``Exchange.drive`` steps flow.decide and does each
operation's I/O: reads the body (the app gets it again from a fresh ``wsgi.input``),
claims (in the request's Session when transactional), runs the app with its whole
response held back (wsgi_held.py) while a thread renews the lease, completes or
releases, then returns what flow decided to the server.

Past 250 lines on purpose: one class whose methods are the operations of flow.py, each
a few lines of I/O; read beside asgi_exchange.py, method for method.
"""

from __future__ import annotations

import contextlib
import http
import io
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from sqlalchemy.orm import Session

from . import exchange, flow
from .policy import RoutePolicy
from .sql_store import ClaimLost, SqlStore
from .store import Claimed, ClaimResult
from .stored import REPLAYED_HEADER, StoredResponse
from .transactional import complete_and_commit, hold_commits
from .wsgi_held import HeldResponse, LeaseRenewer, read_exactly

Environ = dict[str, Any]
StartResponse = Callable[..., Callable[[bytes], object]]
WSGIApp = Callable[[Environ, StartResponse], Iterable[bytes]]


class Owner(Protocol):
    """What an exchange reads of its middleware (wsgi.WSGIIdempotencyMiddleware); a
    protocol, so that this module does not import the one that imports it."""

    @property
    def app(self) -> WSGIApp: ...
    @property
    def engine(self) -> Any: ...
    @property
    def store(self) -> Any: ...
    @property
    def sql_store(self) -> SqlStore | None: ...
    @property
    def session_factory(self) -> Any: ...


def _status_line(status: int) -> str:
    try:
        return f"{status} {http.HTTPStatus(status).phrase}"
    except ValueError:
        return f"{status} Unknown"


class _ClientGone(Exception):
    """The client sent less body than it announced: it went away; nothing was claimed."""


class Exchange:
    """One request through the middleware: carries out flow's operations, blocking."""

    def __init__(self, owner: Owner, environ: Environ, start_response: StartResponse) -> None:
        self.owner = owner
        self.environ = environ
        self.start_response = start_response
        self.session: Session | None = None
        self.held: flow.Claim | None = None
        self.token = ""
        self.claim_sent = 0.0
        self.response: HeldResponse | None = None
        self.allow_commit: Callable[[], None] | None = None

    def drive(self, steps: Any) -> Iterable[bytes]:
        try:
            step = flow.advance(steps, None)
            while not isinstance(step, flow.Decision):
                step = flow.advance(steps, self.carry_out(step))
            return self.finish(step)
        except _ClientGone:
            self.abandon()
            return []
        except BaseException:
            self.abandon()
            raise
        finally:
            self.close_session()

    def carry_out(self, operation: flow.Operation) -> Any:
        match operation:
            case flow.ReadBody(limit):
                return self.read_body(limit)
            case flow.Claim():
                return self.claim(operation)
            case flow.Pause(seconds):
                time.sleep(seconds)
                return None
            case flow.Run(token, policy):
                self.token = token
                return self.run(policy)
            case flow.Complete(scope, key, token, response, expiry):
                return self.complete(scope, key, token, response, expiry)
            case flow.Release(scope, key, token):
                self.release(scope, key, token)
                return None
        raise AssertionError(f"unknown operation {operation!r}")

    def read_body(self, limit: int) -> bytes | None:
        """The whole body (the app gets it again from a fresh wsgi.input); None past limit."""
        stream = self.environ["wsgi.input"]
        announced = self.environ.get("CONTENT_LENGTH") or ""
        if announced.strip():
            try:
                length = int(announced)
            except ValueError:
                length = -1
            if length < 0 or length > limit:
                return None  # an unreadable length is refused like an oversized one (413)
            body = read_exactly(stream, length)
            if len(body) < length:
                raise _ClientGone()
        elif self.environ.get("wsgi.input_terminated"):
            body = read_exactly(stream, limit + 1)
            if len(body) > limit:
                return None
        else:
            body = b""  # no Content-Length and no terminated input: no body (PEP 3333)
        self.environ["wsgi.input"] = io.BytesIO(body)
        self.environ["CONTENT_LENGTH"] = str(len(body))
        return body

    def claim(self, claim: flow.Claim) -> ClaimResult | flow.StoreFailed | flow.StoreBusy:
        args = (claim.scope, claim.key, claim.fingerprint)
        self.claim_sent = exchange.LeaseWatch.now()
        if not claim.policy.transactional:
            try:
                result: ClaimResult | flow.StoreFailed | flow.StoreBusy = self.owner.store.claim(
                    *args, claim.policy.lease
                )
            except Exception as error:
                result = exchange.claim_failed(error, claim.scope)
        else:
            store = self.owner.sql_store
            assert store is not None  # the policy property refused transactional without it
            self.session = exchange.new_session(self.owner.session_factory, self.owner.engine)
            try:
                wait, lease = claim.policy.wait, claim.policy.lease
                result = store.claim_in(self.session, *args, wait, lease)
            except Exception as error:
                self.close_session()
                result = exchange.claim_in_failed(error, store.engine.dialect.name, claim.scope)
            if not isinstance(result, Claimed):
                self.close_session()
        if isinstance(result, Claimed):
            self.held = claim
        return result

    def run(self, policy: RoutePolicy) -> flow.RunResult:
        environ = dict(self.environ)
        if self.session is not None:
            environ[exchange.SESSION_KEY] = self.session
            self.allow_commit = hold_commits(self.session)
        self.response = captured = HeldResponse(policy.max_stored_body)
        renewer = watch = None
        if not policy.transactional:  # a transactional claim is its transaction: no lease
            assert self.held is not None
            held = self.held
            watch = exchange.LeaseWatch(policy.lease, self.claim_sent)
            renewer = LeaseRenewer(
                self.owner.store, held.scope, held.key, self.token, policy.lease, watch
            )
        try:
            captured.collect(self.owner.app(environ, captured.start_response))
        except Exception as error:
            captured.error = error  # re-raised to the server once the claim is released
            captured.close()
            return flow.Crashed(error, self.lapsed(renewer, watch))
        finally:
            if renewer is not None:
                renewer.stop()  # the claim ends now: stored, not stored, or released
        lapsed = self.lapsed(renewer, watch)
        if captured.status is None:
            captured.error = RuntimeError("the WSGI app returned without calling start_response")
            captured.close()
            return flow.Crashed(captured.error, lapsed)
        if captured.overflowed:
            return flow.Overflowed(captured.status, lapsed)
        response = StoredResponse.capture(captured.status, captured.headers, captured.body)
        return flow.Finished(response, lapsed)

    @staticmethod
    def lapsed(renewer: LeaseRenewer | None, watch: exchange.LeaseWatch | None) -> bool:
        """Whether the lease ran out during the run (read once the renewer has stopped)."""
        if renewer is None or watch is None:
            return False
        renewer.stop()  # idempotent: joined, so the watch is read after its last renewal
        return watch.lapsed()

    def complete(
        self, scope: str, key: str, token: str, response: StoredResponse, expiry: Any
    ) -> bool | flow.ClaimLost:
        assert self.held is not None
        held = self.held
        if not held.policy.transactional:
            self.held = None
            try:
                return bool(self.owner.store.complete(scope, key, token, response, expiry))
            except Exception:
                # The endpoint's effects are done: answer; the claim lapses with its lease.
                exchange.log.exception("idempotency response could not be stored for %s", scope)
                return False
        store, session, allow = self.owner.sql_store, self.session, self.allow_commit
        assert store is not None and session is not None and allow is not None
        try:
            complete_and_commit(store, session, allow, scope, key, token, response, expiry)
        except ClaimLost:
            exchange.log_rolled_back(scope)
            self.rolled_back()
            return flow.ClaimLost()
        except Exception:
            exchange.log.exception("idempotency commit failed for %s", scope)
            self.rolled_back()
            return False
        self.held = None
        return True

    def release(self, scope: str, key: str, token: str) -> None:
        if self.held is not None and self.held.policy.transactional:
            self.rolled_back()  # rolls the endpoint's writes and the claim back
        else:
            self.held = None
            self.owner.store.release(scope, key, token)

    def finish(self, decision: flow.Decision) -> Iterable[bytes]:
        if isinstance(decision, flow.PassThrough):
            return self.owner.app(self.environ, self.start_response)
        if isinstance(decision, flow.Respond):
            response = decision.response
            headers = [*response.headers, *([REPLAYED_HEADER] if decision.replayed else [])]
            self.start_response(_status_line(response.status), list(headers))
            if self.response is not None:  # a run whose commit failed: the app's close() too
                self.response.close()
            return [response.body]
        captured = self.response
        assert captured is not None
        if captured.error is not None:
            raise captured.error
        assert captured.status_line is not None
        self.start_response(captured.status_line, captured.headers, captured.exc_info)
        return captured.rest()

    def abandon(self) -> None:
        """Failed mid-way: never leave a claim behind (the retry runs afresh)."""
        if self.response is not None:
            self.response.close()
        held = self.held
        if held is None:
            return
        if held.policy.transactional:
            self.rolled_back()
            return
        self.held = None
        with contextlib.suppress(Exception):
            self.owner.store.release(held.scope, held.key, self.token)

    def rolled_back(self) -> None:
        """A transactional request that did not complete: roll it back, then make sure its
        claim was not committed by the endpoint itself (exchange.COMMITTED_BEHIND)."""
        held, self.held = self.held, None
        self.close_session()
        store = self.owner.sql_store
        if held is None or store is None:
            return
        args = (held.scope, held.key, self.token, exchange.COMMITTED_BEHIND, held.policy.expiry)
        try:
            if store.complete(*args):
                exchange.log_committed_behind(held.scope)
        except Exception:
            exchange.log.exception("idempotency claim could not be checked for %s", held.scope)

    def close_session(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            with contextlib.suppress(Exception):
                session.close()
