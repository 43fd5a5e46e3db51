"""The admin pages (consumerdedup.admin) beside ``consumerdedup run``'s probes.

``app.admin(authorize=..., actions=...)`` declares who may see and who may act (code's
concern); ``CONSUMERDEDUP_ADMIN_PORT`` / ``--admin-port`` says where (the deployment's).
The supervisor serves the pages, once, in a thread of its own process (uvicorn on a
socket it bound itself, so a port taken is said at start); no worker child does.

Deny by default, as ``admin_app`` is: without ``authorize`` or a token
(``CONSUMERDEDUP_ADMIN_TOKEN`` or ``app.admin(token=...)``) the run is refused, unless
``app.admin(allow_loopback=True)`` says any client of this host may act; the bind
address is 127.0.0.1, and any other needs a token. Read-only unless ``actions=True``.
"""

from __future__ import annotations

import importlib.util
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import options
from ..errors import ConfigurationError
from ..loopback import is_loopback

log = logging.getLogger("consumerdedup.run")
TOKEN_VARIABLE = "CONSUMERDEDUP_ADMIN_TOKEN"
START_TIMEOUT = 20.0
"""Seconds the admin server may take to start listening on its bound socket."""


@dataclass(frozen=True)
class AdminDeclaration:
    """What ``app.admin(...)`` declared: ``admin_app``'s options, and a default port."""

    authorize: Callable[..., Any] | None = None
    token: str | None = field(default=None, repr=False)
    allow_loopback: bool = False
    actions: bool = False
    replay: Callable[..., Any] | None = None
    audit: Any = None  # a callable, "table" or None (checked by declare_admin)
    show_bodies: bool = False
    port: int | None = None


def declare_admin(**given: Any) -> AdminDeclaration:
    """The declaration, every option checked here (a ConfigurationError naming it)."""
    if importlib.util.find_spec("starlette") is None or importlib.util.find_spec("uvicorn") is None:
        raise ConfigurationError(
            "app.admin(...) needs the admin extra: pip install 'consumerdedup[admin]'"
        )
    for name in ("authorize", "replay", "audit"):
        if given.get(name) is not None and not callable(given[name]):
            if name == "audit" and given[name] == "table":  # admin_audit (init-db --admin-audit)
                continue
            expected = "a callable, 'table' or None" if name == "audit" else "a callable or None"
            raise options.refuse(f"app.admin({name}=...)", given[name], expected)
    for name in ("allow_loopback", "actions", "show_bodies"):
        options.boolean(given.get(name, False), f"app.admin({name}=...)")
    token = options.maybe(given.get("token"), "app.admin(token=...)", options.text, secret=True)
    if token is not None and len(token) < 16:
        raise ConfigurationError("app.admin(token=...): expected at least 16 characters")
    options.maybe(given.get("port"), "app.admin(port=...)", options.integer, at_least=1,
                  at_most=65535)  # fmt: skip
    return AdminDeclaration(**given)


def admin_server(app: Any, settings: Any, port: int | None, host: str) -> AdminServer | None:
    """The admin server for ``app`` (not started), or None when no port is set anywhere.
    ``port``: the flag's or the setting's (0: any free one), else ``app.admin(port=...)``.
    A ConfigurationError when the pages would be open to anyone."""
    declared: AdminDeclaration | None = getattr(app, "admin_declaration", None)
    if port is None and declared is not None:
        port = declared.port
    if port is None:
        return None
    if not hasattr(app, "resources"):
        raise ConfigurationError(
            f"the admin pages need a consumerdedup App to read from, not a {type(app).__name__}"
        )
    token = settings.secret("admin_token") if settings is not None else None
    declared = declared or AdminDeclaration()
    token = token or declared.token
    if declared.authorize is None and token is None and not declared.allow_loopback:
        raise ConfigurationError(
            f"the admin pages need to know who may see them: declare app.admin(authorize=...) "
            f"(your auth), or set {TOKEN_VARIABLE}, or app.admin(allow_loopback=True) to let "
            "any client of this host in"
        )
    if token is None and not is_loopback(host):
        raise ConfigurationError(
            f"admin host {host} is not loopback: set {TOKEN_VARIABLE} (every request must "
            "then carry it), or bind 127.0.0.1"
        )
    from ..admin import admin_app

    resources = app.resources(settings)
    page = admin_app(
        resources.engine(), tables=app.tables, authorize=declared.authorize, token=token,
        allow_loopback=declared.allow_loopback and is_loopback(host), actions=declared.actions,
        replay=declared.replay, audit=declared.audit, show_bodies=declared.show_bodies,
        title=str(app.name),
    )  # fmt: skip
    guard = "token required" if token else "authorize" if declared.authorize else "loopback"
    mode = "actions enabled" if declared.actions else "read-only"
    return AdminServer(page, host, port, f"{mode}, {guard}", resources.close)


class AdminServer:
    """uvicorn serving ``page`` in a daemon thread, on a socket bound at ``start()``."""

    def __init__(
        self, page: Any, host: str, port: int, mode: str, close: Callable[[], None]
    ) -> None:
        self.page, self.host, self.port, self.mode = page, host, port, mode
        self._close = close
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> AdminServer:
        import uvicorn

        try:
            family = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0][0]
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(128)
        except OSError as error:
            raise ConfigurationError(
                f"admin port {self.port} on {self.host}: cannot listen ({error.strerror})"
            ) from None
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.page,
            log_config=None,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,  # a page's open event stream must not hold the stop
        )  # fmt: skip  (log_config=None: uvicorn's own would replace the run's JSON logging)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="admin", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                sock.close()
                raise ConfigurationError(f"the admin pages did not start on port {self.port}")
            time.sleep(0.01)
        log.info("admin pages on http://%s:%d/ (%s)", self.host, self.port, self.mode)
        return self

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
        self._close()
