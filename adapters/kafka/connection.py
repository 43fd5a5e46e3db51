"""The aiokafka clients, made from our settings plus pass-through options.

What the guarantees depend on (the group, auto-commit off, acks=all, idempotence)
is set here and refused in the options, before anything connects.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer  # type: ignore[import-untyped]
from aiokafka import errors as kafka_errors
from aiokafka.conn import create_conn  # type: ignore[import-untyped]

from consumerdedup import ConfigurationError
from consumerdedup.options import refuse
from consumerdedup.reasons import describe

from .errors import AuthenticationFailed

logger = logging.getLogger("consumerdedup.kafka")

CLOSE_TIMEOUT = 10.0
"""Seconds a consumer's close may take. aiokafka's ``stop()`` first waits for its group
coordination, which can be inside a JoinGroup the broker holds until every member has
rejoined (up to the rebalance timeout, or for ever on a broker that loses track): a stop
must not wait on that. Nothing is committed at close (auto-commit is off)."""

RUNNER_OWNED = {"bootstrap_servers", "group_id", "enable_auto_commit"}
PUBLISHER_OWNED = {"bootstrap_servers", "acks", "enable_idempotence"}


def check_bootstrap(servers: object) -> None:
    """ConfigurationError unless ``servers`` is ``host[:port][,host[:port]...]`` or a list of
    ``host[:port]``: caught at construction, not charged to the first event sent."""
    hint = "bootstrap_servers must be host:port[,host:port...] (consumerdedup relay --kafka)"
    if isinstance(servers, str):
        entries = servers.split(",")
    elif isinstance(servers, Sequence) and all(isinstance(s, str) for s in servers):
        entries = list(servers)
    else:
        raise refuse("bootstrap_servers", servers, "host:port[,host:port...] or a list of them")
    if not entries:
        raise ConfigurationError(f"{hint}, got none")
    for entry in (e.strip() for e in entries):
        if "://" in entry:
            scheme = entry.partition("://")[0]
            raise ConfigurationError(f"{hint}, not a URL: got a {scheme}:// address")
        if "@" in entry:  # never echoed: it may carry a password
            raise ConfigurationError(f"{hint}; credentials go in the options (sasl_*)")
        host, port = _host_port(entry)
        if not host or "/" in host or (port is not None and not 0 < port < 65536):
            raise ConfigurationError(f"{hint}, got {entry[:80]!r}")


def _host_port(entry: str) -> tuple[str, int | None]:
    """(host, port) as aiokafka will read ``entry``; ("", None) for a form it would misread
    (more than one ':' outside brackets, an unclosed bracket, a bracket around a non-IPv6
    host, a space or a non-ASCII digit in it)."""
    bad = "", None
    if any(c.isspace() for c in entry):
        return bad
    if entry.startswith("["):  # [IPv6]:port
        host, closed, rest = entry[1:].partition("]")
        if not closed or not _ipv6(host):
            return bad
        port: str | None = rest[1:] if rest.startswith(":") else (None if not rest else "bad")
    elif entry.count(":") == 1:
        host, _, port = entry.partition(":")
    elif ":" in entry and not _ipv6(entry):  # host:port:more, not an IPv6 address
        return bad
    else:
        host, port = entry, None
    if port is None:
        return host, None
    return host, int(port) if port.isascii() and port.isdigit() else -1


def _ipv6(host: str) -> bool:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return False
    return True


def reject_owned(name: str, options: Mapping[str, Any], owned: set[str]) -> None:
    clash = sorted(owned.intersection(options))
    if clash:
        raise ConfigurationError(
            f"{name} must not set {', '.join(clash)}: the runner or publisher sets it "
            "(bootstrap_servers and group_id are arguments; auto-commit stays off, acks=all)"
        )


def consumer(
    bootstrap_servers: str | Sequence[str], group_id: str, options: Mapping[str, Any]
) -> Any:
    """A group member that commits only what the runner commits; a new group reads from
    the start (``auto_offset_reset`` "earliest" unless ``options`` say otherwise)."""
    reject_owned("consumer_options", options, RUNNER_OWNED)
    return AIOKafkaConsumer(
        **{"auto_offset_reset": "earliest", **options},
        bootstrap_servers=bootstrap_servers,
        group_id=group_id,
        enable_auto_commit=False,
    )


async def close_consumer(consumer: Any, timeout: float = CLOSE_TIMEOUT) -> None:
    """``consumer.stop()``, given at most ``timeout`` seconds. Past them its group
    coordination is cancelled and its connections closed without a LeaveGroup: the group
    rebalances after the member's session times out, and the next owner reads from the
    committed offsets, so nothing is lost or skipped."""
    closing = asyncio.ensure_future(consumer.stop())
    try:
        done, _ = await asyncio.wait({closing}, timeout=timeout)
    except asyncio.CancelledError:
        closing.cancel()
        raise
    if done:
        closing.result()
        return
    logger.warning(
        "the Kafka consumer did not close within %.0fs (its group coordinator did not "
        "answer: a join or leave in progress at the broker); closing its connections without "
        "leaving the group, which rebalances once session_timeout_ms passes",
        timeout,
    )
    closing.cancel()  # cancels the coordination task its stop() was waiting for
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await closing
    await _close_connections(consumer)


async def _close_connections(consumer: Any) -> None:
    """What ``AIOKafkaConsumer.stop()`` does after its coordinator closes, which a cancelled
    stop() never reached (aiokafka has no public way to close without the coordinator)."""
    coordinator = getattr(consumer, "_coordinator", None)
    for name in ("_coordination_task", "_heartbeat_task", "_commit_refresh_task"):
        task = getattr(coordinator, name, None)
        if isinstance(task, asyncio.Future) and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    fetcher = getattr(consumer, "_fetcher", None)
    if fetcher is not None:
        with contextlib.suppress(Exception):
            await fetcher.close()
    client = getattr(consumer, "_client", None)
    if client is not None:
        with contextlib.suppress(Exception):
            await client.close()


def producer_settings(
    bootstrap_servers: str | Sequence[str], enable_idempotence: bool, options: Mapping[str, Any]
) -> dict[str, Any]:
    """A producer's settings: acknowledged by every in-sync replica, idempotent if asked."""
    reject_owned("options", options, PUBLISHER_OWNED)
    return {
        **options,
        "bootstrap_servers": bootstrap_servers,
        "acks": "all",
        "enable_idempotence": enable_idempotence,
    }


def producer(settings: Mapping[str, Any]) -> Any:
    return AIOKafkaProducer(**settings)


SASL_FAILURES: tuple[type[BaseException], ...] = (
    kafka_errors.SaslAuthenticationFailed,
    kafka_errors.AuthenticationFailedError,
    kafka_errors.AuthenticationMethodNotSupported,
    kafka_errors.UnsupportedSaslMechanismError,
    kafka_errors.IllegalSaslStateError,
)
"""aiokafka's words for refused SASL credentials or mechanism: AuthenticationFailed, fatal."""


def authentication_failed(exc: BaseException, where: object) -> AuthenticationFailed:
    """AuthenticationFailed for a SASL failure, naming the broker and the options to check."""
    return AuthenticationFailed(
        f"the Kafka broker at {where} refused the credentials ({describe(exc)}): check "
        "sasl_mechanism, sasl_plain_username and sasl_plain_password (or the security_protocol)"
    )


_SASL_OPTIONS = (
    "ssl_context",
    "security_protocol",
    "sasl_mechanism",
    "sasl_plain_username",
    "sasl_plain_password",
    "sasl_kerberos_service_name",
    "sasl_kerberos_domain_name",
    "sasl_oauth_token_provider",
)


async def sasl_refusal(
    bootstrap_servers: str | Sequence[str], options: Mapping[str, Any]
) -> BaseException | None:
    """Why the first bootstrap server refuses our SASL handshake, or None.

    aiokafka logs a SASL failure during its bootstrap and raises only "Unable to
    bootstrap" (a KafkaConnectionError, BrokerUnavailable to us, retried forever); after
    such a failure with a SASL security_protocol, one connection of our own asks again,
    and its error says whether the credentials were the cause.
    """
    if not str(options.get("security_protocol", "")).startswith("SASL"):
        return None
    entries = (
        bootstrap_servers.split(",") if isinstance(bootstrap_servers, str) else bootstrap_servers
    )
    host, port = _host_port(next(iter(entries)).strip())
    settings = {k: options[k] for k in _SASL_OPTIONS if k in options}
    try:
        conn = await create_conn(host, port or 9092, request_timeout_ms=10000, **settings)
    except SASL_FAILURES as exc:
        return exc
    except Exception:  # unreachable, or another failure: not the credentials
        return None
    conn.close()
    return None
