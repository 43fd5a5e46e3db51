"""Connection parameters from a URL plus pass-through options, and connecting with backoff."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pika  # type: ignore[import-untyped]
import pika.exceptions  # type: ignore[import-untyped]
import tenacity
from pika.adapters.utils.connection_workflow import (  # type: ignore[import-untyped]
    AMQPConnectorStackTimeout,
)

from consumerdedup import ConfigurationError
from consumerdedup.retry import Backoff

from . import undecodable  # noqa: F401  (installs the decoder that reads what pika cannot)
from .errors import AuthenticationFailed, BrokerRefused, BrokerUnavailable

log = logging.getLogger("consumerdedup.rabbitmq")

# Retrying cannot fix these: wrong credentials, a missing vhost, a non-AMQP port.
_REFUSED = (
    pika.exceptions.AuthenticationError,
    pika.exceptions.ProbableAuthenticationError,
    pika.exceptions.ProbableAccessDeniedError,
    pika.exceptions.IncompatibleProtocolError,
)
_AUTHENTICATION = (pika.exceptions.AuthenticationError, pika.exceptions.ProbableAuthenticationError)
"""ACCESS_REFUSED on login: the user or the password (AuthenticationFailed)."""
# pika raises its own (not an AMQPConnectionError) when a port takes the TCP connection and
# never answers the AMQP handshake: not a RabbitMQ port, or one too busy to answer.
_UNANSWERED = (pika.exceptions.AMQPConnectionError, AMQPConnectorStackTimeout)


def parameters(url: str, options: Mapping[str, Any], name: str) -> Any:
    """pika URLParameters for ``url`` with ``options`` set over it and ``name`` as connection name.

    Raises ConfigurationError for a bad URL or option, before anything connects.
    """
    scheme = url.partition("://")[0].lower() if isinstance(url, str) and "://" in url else ""
    if scheme not in ("amqp", "amqps"):
        raise ConfigurationError(
            "a RabbitMQ URL must be amqp://user:password@host:5672/vhost (or amqps://), got "
            + (f"a {scheme}:// URL" if scheme else "no amqp:// scheme")
        )
    try:
        params = pika.URLParameters(url)
    except (ValueError, TypeError) as exc:
        raise ConfigurationError(_unreadable_url(url, exc)) from None
    try:
        for option, value in options.items():
            if not isinstance(getattr(type(params), option, None), property):
                raise ConfigurationError(f"unknown pika connection option {option!r}")
            setattr(params, option, value)
    except (ValueError, TypeError) as exc:
        raise ConfigurationError(f"cannot use RabbitMQ URL/options: {exc}") from exc
    properties = dict(params.client_properties or {})
    properties.setdefault("connection_name", name)
    params.client_properties = properties
    return params


def _unreadable_url(url: str, exc: BaseException) -> str:
    """Why ``url`` cannot be read, never quoting it: a password with an unescaped / # ? ends
    the authority early, and the parser's words then name a piece of it (as "the port")."""
    hint = (
        "cannot read the RabbitMQ URL: it must be amqp://user:password@host:5672/vhost, "
        "with / # ? @ : % in the user or password percent-encoded (%2F %23 %3F %40 %3A %25)"
    )
    if "@" in url:  # credentials in it: the parser's words may quote them
        return f"{hint} ({type(exc).__name__})"
    return f"{hint}: {exc}"


def connect(
    params: Any,
    *,
    backoff: Backoff,
    give_up_after: timedelta | None,
    stopping: Callable[[], bool],
    pause: Callable[[float], Any],
) -> Any:
    """A BlockingConnection, retried with ``backoff``; None if stopped first."""
    stop: Any = lambda state: stopping()  # noqa: E731 - tenacity takes any callable
    if give_up_after is not None:
        stop = tenacity.stop_any(stop, tenacity.stop_after_delay(give_up_after.total_seconds()))
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(
            lambda exc: isinstance(exc, _UNANSWERED) and not isinstance(exc, _REFUSED)
        ),
        wait=backoff,
        stop=stop,
        sleep=pause,
        before_sleep=_log_attempt,
        reraise=True,
    )
    where = f"{params.host}:{params.port}"
    try:
        return retrying(pika.BlockingConnection, params)
    except _AUTHENTICATION as exc:
        raise AuthenticationFailed(
            f"RabbitMQ at {where} refused the credentials of user {params.credentials.username!r} "
            f"({type(exc).__name__}: {_reply(exc)}): check the user and password in the URL"
        ) from exc
    except _REFUSED as exc:
        raise BrokerRefused(
            f"RabbitMQ at {where} refused the connection ({type(exc).__name__}: "
            f"{_reply(exc)}): check the URL's user, password and vhost, and that the port "
            "is AMQP's"
        ) from exc
    except _UNANSWERED as exc:
        if stopping():
            return None
        why = repr(exc)
        if isinstance(exc, AMQPConnectorStackTimeout):
            why = "no answer to the AMQP handshake (is it RabbitMQ's AMQP port?)"
        raise BrokerUnavailable(f"cannot connect to RabbitMQ at {where}: {why}") from exc


def _reply(exc: BaseException) -> str:
    """pika's words for a refusal (the broker's reply text; never the password we sent)."""
    return " ".join(str(arg) for arg in exc.args)[:200] or "no reason given"


def close_quietly(connection: Any) -> None:
    """Close, ignoring a connection that is already gone: the broker requeues what was unacked."""
    if connection is None:
        return
    try:
        if connection.is_open:
            connection.close()
    except Exception as exc:  # a dead socket cannot be closed politely
        log.debug("closing the RabbitMQ connection: %r", exc)


def _log_attempt(state: tenacity.RetryCallState) -> None:
    error = state.outcome.exception() if state.outcome else None
    wait = state.next_action.sleep if state.next_action else 0.0
    log.warning(
        "RabbitMQ connection attempt %d failed (%r); next in %.1fs",
        state.attempt_number,
        error,
        wait,
    )


_handling = threading.local()  # .depth: this thread is inside losses_handled()


class _PikaLinesWeHandle(logging.Filter):
    """pika's lines written in a thread inside ``losses_handled()``: DEBUG, so kept only
    where pika's DEBUG is on (a handler's own level may let a demoted line through, so
    the logger's decides)."""

    installed = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(_handling, "depth", 0) or record.levelno <= logging.DEBUG:
            return True
        if not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            return False
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


_DEMOTE = _PikaLinesWeHandle()


@contextmanager
def losses_handled() -> Iterator[None]:
    """What pika logs in this thread meanwhile is DEBUG (dropped unless pika's DEBUG is on):
    the caller handles what pika raises (a lost connection or channel) and says so in one
    line of its own.

    pika logs a lost connection from several loggers at ERROR, some with a traceback, then
    raises it to its caller: a burst of lines for one reconnect, in the service's log.
    Records of other threads, and pika's lines outside such a block, are left alone.
    """
    if not _DEMOTE.installed:  # on every pika logger: a filter applies to its own logger only
        for name in [n for n in logging.root.manager.loggerDict if n.split(".")[0] == "pika"]:
            logging.getLogger(name).addFilter(_DEMOTE)
        _DEMOTE.installed = True
    _handling.depth = getattr(_handling, "depth", 0) + 1
    try:
        yield
    finally:
        _handling.depth -= 1


def header_frame_size(properties: Any) -> int:
    """Bytes of the content-header frame that would carry ``properties``: class, weight and
    body size (12), the encoded properties, the frame's own header and end (8)."""
    return 20 + len(b"".join(properties.encode()))


def frame_max(connection: Any, params: Any) -> int:
    """The frame size the broker and we agreed on (pika keeps it on the connection's
    parameters after the tune); what we asked for if that cannot be read."""
    agreed = getattr(getattr(getattr(connection, "_impl", None), "params", None), "frame_max", None)
    return agreed if isinstance(agreed, int) else int(params.frame_max)
