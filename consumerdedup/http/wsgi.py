"""``WSGIIdempotencyMiddleware(app, engine)``: the idempotency-key algorithm for WSGI apps.

The twin of the ASGI middleware (asgi.py) for Flask, Django and any WSGI app: it drives
the same flow.decide, so the two cannot disagree on a rule; only the I/O differs. It reads
the request body whole (to fingerprint it, then hands the app a fresh ``wsgi.input``),
claims the key, runs the app with its whole response held back (while a thread renews the
lease), stores the response, and only then returns it to the server. A response longer
than the route's max_stored_body is recorded as not stored before its first byte leaves,
then streamed: a retry gets a 409 problem, never a second run. In transactional mode the
app finds the request's Session at ``environ["consumerdedup.session"]``; its writes commit
with the stored response before the response is returned.
"""

from __future__ import annotations

import contextlib
import http
import inspect
import io
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ..errors import ConfigurationError
from ..schema import DEFAULT, Tables
from . import flow
from .asgi import SESSION_KEY  # the same key in the WSGI environ as in the ASGI scope
from .policy import IdempotencyPolicy, RoutePolicy
from .sql_statements import is_lock_timeout
from .sql_store import ClaimLost, SqlStore
from .store import Claimed, ClaimResult, InFlight
from .stored import REPLAYED_HEADER, StoredResponse
from .transactional import hold_commits
from .wsgi_held import HeldResponse, LeaseRenewer, read_exactly

Environ = dict[str, Any]
StartResponse = Callable[..., Callable[[bytes], object]]
WSGIApp = Callable[[Environ, StartResponse], Iterable[bytes]]
Principal = Callable[[Mapping[str, Any]], "str | int | None"]

log = logging.getLogger("consumerdedup.http")
_HEADERS_WITHOUT_PREFIX = {"CONTENT_TYPE": "content-type", "CONTENT_LENGTH": "content-length"}


class WSGIIdempotencyMiddleware:
    """Idempotency keys for a WSGI app; ``engine`` (a blocking Engine) holds the records.

    The same options as the ASGI IdempotencyMiddleware: ``store`` (a blocking
    IdempotencyStore, e.g. RedisStore, for non-transactional routes), ``policy``,
    ``routes`` (objects with ``.path`` and ``.endpoint`` whose ``@idempotent`` marks join
    the policy), ``principal(environ)`` (who is calling: part of every key's scope),
    ``session_factory`` (the transactional Session; default ``Session(engine)``).
    """

    def __init__(
        self,
        app: WSGIApp,
        engine: Engine | None = None,
        *,
        store: Any = None,
        policy: IdempotencyPolicy | None = None,
        routes: Iterable[object] = (),
        principal: Principal | None = None,
        tables: Tables = DEFAULT,
        session_factory: Callable[[], Session] | None = None,
    ) -> None:
        if engine is not None and not isinstance(engine, Engine):
            raise ConfigurationError(
                f"WSGIIdempotencyMiddleware: {engine!r} is not a blocking SQLAlchemy Engine "
                "(a WSGI app runs in threads; give an AsyncEngine to the ASGI middleware)"
            )
        self.app = app
        self.engine = engine
        self.sql_store = SqlStore(engine, tables) if engine is not None else None
        if store is None and self.sql_store is None:
            raise ConfigurationError("WSGIIdempotencyMiddleware needs an engine or a store")
        self.store: Any = store if store is not None else self.sql_store
        for name in ("claim", "renew", "complete", "release"):
            method = getattr(self.store, name, None)
            if not callable(method) or inspect.iscoroutinefunction(method):
                raise ConfigurationError(
                    f"WSGIIdempotencyMiddleware: the store's {name}() must be a blocking "
                    "method (an IdempotencyStore such as SqlStore or RedisStore, not an async one)"
                )
        self._base = policy if policy is not None else IdempotencyPolicy()
        self._routes = routes
        self._policy: IdempotencyPolicy | None = None
        self._policy_lock = threading.Lock()
        self.principal = principal
        self.session_factory = session_factory

    @property
    def policy(self) -> IdempotencyPolicy:
        """The policy with the routes' marks; resolved once, at the first request."""
        with self._policy_lock:
            if self._policy is None:
                self._policy = self._base.for_middleware(
                    self._routes,
                    has_engine=self.sql_store is not None,
                    middleware="WSGIIdempotencyMiddleware",
                )
            return self._policy

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        principal = self.principal(environ) if self.principal is not None else None
        incoming = flow.Incoming(
            environ["REQUEST_METHOD"],
            _path(environ),
            environ.get("QUERY_STRING", "").encode("latin-1"),
            _headers(environ),
            principal,
        )
        return _Exchange(self, environ, start_response).drive(flow.decide(incoming, self.policy))


def _path(environ: Environ) -> str:
    """The full path as ASGI spells it: WSGI gives latin-1 str of the raw bytes."""
    path = str(environ.get("SCRIPT_NAME", "")) + str(environ.get("PATH_INFO", ""))
    return path.encode("latin-1").decode("utf-8", "surrogateescape")


def _headers(environ: Environ) -> tuple[tuple[str, str], ...]:
    pairs = []
    for name, value in environ.items():
        if name.startswith("HTTP_"):
            pairs.append((name[5:].replace("_", "-").lower(), str(value)))
        elif name in _HEADERS_WITHOUT_PREFIX and value:
            pairs.append((_HEADERS_WITHOUT_PREFIX[name], str(value)))
    return tuple(pairs)


def _status_line(status: int) -> str:
    try:
        return f"{status} {http.HTTPStatus(status).phrase}"
    except ValueError:
        return f"{status} Unknown"


class _ClientGone(Exception):
    """The client sent less body than it announced: it went away; nothing was claimed."""


class _Exchange:
    """One request through the middleware: carries out flow's operations, blocking."""

    def __init__(
        self, owner: WSGIIdempotencyMiddleware, environ: Environ, start_response: StartResponse
    ) -> None:
        self.owner = owner
        self.environ = environ
        self.start_response = start_response
        self.session: Session | None = None
        self.held: flow.Claim | None = None
        self.token = ""
        self.response: HeldResponse | None = None
        self.allow_commit: Callable[[], None] | None = None

    def drive(self, steps: Any) -> Iterable[bytes]:
        reply: Any = None
        try:
            while True:
                try:
                    operation = steps.send(reply)
                except StopIteration as stop:
                    decision: flow.Decision = stop.value
                    break
                reply = self.carry_out(operation)
            return self.finish(decision)
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
        if not claim.policy.transactional:
            try:
                result: ClaimResult = self.owner.store.claim(*args, claim.policy.lease)
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
                wait, lease = claim.policy.wait, claim.policy.lease
                result = store.claim_in(self.session, *args, wait, lease)
            except Exception as error:
                if isinstance(error, ConfigurationError):
                    self.close_session()
                    raise
                if not is_lock_timeout(error):
                    log.exception("idempotency store failed to claim for %s", claim.scope)
                    self.close_session()
                    return flow.StoreFailed()
                if store.engine.dialect.name == "sqlite":
                    # SQLite serialises writers: BEGIN IMMEDIATE timed out on the database's
                    # write lock, held by a twin or by any other transactional request.
                    log.info("idempotency store busy for %s: SQLite's write lock", claim.scope)
                    self.close_session()
                    return flow.StoreBusy()
                result = InFlight(1.0)
            if not isinstance(result, Claimed):
                self.close_session()
        if isinstance(result, Claimed):
            self.held = claim
        return result

    def new_session(self) -> Session:
        if self.owner.session_factory is not None:
            return self.owner.session_factory()
        return Session(self.owner.engine, expire_on_commit=False)

    def run(self, policy: RoutePolicy) -> flow.RunResult:
        environ = dict(self.environ)
        if self.session is not None:
            environ[SESSION_KEY] = self.session
            self.allow_commit = hold_commits(self.session)
        self.response = captured = HeldResponse(policy.max_stored_body)
        renewer = None
        if not policy.transactional:
            assert self.held is not None
            held = self.held
            store = self.owner.store
            renewer = LeaseRenewer(store, held.scope, held.key, self.token, policy.lease)
        try:
            captured.collect(self.owner.app(environ, captured.start_response))
        except Exception as error:
            captured.error = error  # re-raised to the server once the claim is released
            captured.close()
            return flow.Crashed(error)
        finally:
            if renewer is not None:
                renewer.stop()  # the claim ends now: stored, not stored, or released
        if captured.status is None:
            captured.error = RuntimeError("the WSGI app returned without calling start_response")
            captured.close()
            return flow.Crashed(captured.error)
        if captured.overflowed:
            return flow.Overflowed(captured.status)
        return flow.Finished(
            StoredResponse.capture(captured.status, captured.headers, captured.body)
        )

    def complete(
        self, scope: str, key: str, token: str, response: StoredResponse, expiry: Any
    ) -> bool | flow.ClaimLost:
        assert self.held is not None
        held, self.held = self.held, None
        if not held.policy.transactional:
            try:
                return bool(self.owner.store.complete(scope, key, token, response, expiry))
            except Exception:
                # The endpoint's effects are done: answer; the claim lapses with its lease.
                log.exception("idempotency response could not be stored for %s", scope)
                return False
        store, session = self.owner.sql_store, self.session
        assert store is not None and session is not None
        try:
            store.complete_in(session, scope, key, response, expiry, token)
            assert self.allow_commit is not None
            self.allow_commit()
            session.commit()
        except ClaimLost:
            log.error(
                "idempotency claim lost %s: the endpoint rolled back the request's "
                "transaction; nothing stored or committed",
                scope,
            )
            self.close_session()
            return flow.ClaimLost()
        except Exception:
            log.exception("idempotency commit failed for %s", scope)
            self.close_session()
            return False
        return True

    def release(self, scope: str, key: str, token: str) -> None:
        held, self.held = self.held, None
        if held is not None and held.policy.transactional:
            self.close_session()  # rolls the endpoint's writes and the claim back
        else:
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
        held, self.held = self.held, None
        if held is None:
            return
        with contextlib.suppress(Exception):
            if held.policy.transactional:
                self.close_session()
            else:
                self.owner.store.release(held.scope, held.key, self.token)

    def close_session(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            with contextlib.suppress(Exception):
                session.close()


__all__ = ["SESSION_KEY", "WSGIIdempotencyMiddleware"]
