"""How long RabbitMQ can deliver a queue's messages again: the queue's message TTL.

AMQP does not show a queue's arguments (a passive declare only says it
exists), so the TTL is read with ``rabbitmqctl`` on the broker's host:
``list_queues name arguments policy`` for the ``x-message-ttl`` argument and
the policy applied, ``list_policies`` for that policy's ``message-ttl``. The
lower of the two applies, as in RabbitMQ. Operator policies and per-message
expirations can only shorten a TTL, so leaving them out keeps records longer,
never shorter. The management HTTP API is not used.

A queue without a TTL keeps a message until it is consumed, so the broker
gives no bound; streams keep messages by size and age per segment. Both, and
a host without rabbitmqctl, raise ``RetentionUnknown``: give the window explicitly.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import pika  # type: ignore[import-untyped]
import pika.exceptions  # type: ignore[import-untyped]

from consumerdedup.errors import ConfigurationError
from consumerdedup.prune.windows import BrokerRetention, RetentionUnknown, SourceRetention

from .config import TTL_ARGUMENT
from .topology import NOT_FOUND, refused

TTL_POLICY = "message-ttl"
RABBITMQCTL = ("rabbitmqctl",)


def queue_retention(
    queue: str, arguments: Mapping[str, Any], policy: Mapping[str, Any] | None
) -> SourceRetention | None:
    """The window a queue's arguments and policy definition give; None when neither sets a TTL."""
    if arguments.get("x-queue-type") == "stream":
        return None
    found = {TTL_ARGUMENT: arguments.get(TTL_ARGUMENT)}
    found[f"policy {TTL_POLICY}"] = (policy or {}).get(TTL_POLICY)
    ttls = {source: int(ms) for source, ms in found.items() if ms is not None}
    if not ttls:
        return None
    source, ms = min(ttls.items(), key=lambda item: item[1])
    return SourceRetention(queue, timedelta(milliseconds=ms), f"{source}={ms}")


def rabbitmq_retention(
    url: str,
    queues: Sequence[str],
    *,
    rabbitmqctl: Sequence[str] = RABBITMQCTL,
    timeout: float = 30.0,
) -> BrokerRetention:
    """Check the queues exist (AMQP), then read their TTLs with ``rabbitmqctl``."""
    names = _names(queues)
    params = pika.URLParameters(url)
    vhost = params.virtual_host
    _check_exist(params, names)
    listed = _ctl(rabbitmqctl, ["list_queues", "-p", vhost, "name", "arguments", "policy"], timeout)
    policies = {
        p["name"]: _definition(p)
        for p in _ctl(rabbitmqctl, ["list_policies", "-p", vhost], timeout)
    }
    rows = {row["name"]: row for row in listed}
    found: dict[str, SourceRetention | None] = {}
    for name in names:
        row = rows.get(name, {})
        found[name] = queue_retention(
            name, _arguments(row.get("arguments")), policies.get(row.get("policy") or "")
        )
    if silent := [q for q, retention in found.items() if retention is None]:
        raise RetentionUnknown(
            f"queue(s) {', '.join(silent)} in vhost {vhost!r} have no message TTL (no "
            f"{TTL_ARGUMENT} argument, no policy setting {TTL_POLICY}; or they are streams): a "
            "message waits until it is consumed, so the retention must be given explicitly; "
            "declare them with RabbitConfig(message_ttl=...) (with declare=True) or set a "
            f"policy with {TTL_POLICY} to have prune read it"
        )
    return BrokerRetention.of(
        f"rabbitmq vhost {vhost}", (r for r in found.values() if r is not None)
    )


def _check_exist(params: Any, queues: Sequence[str]) -> None:
    connection = pika.BlockingConnection(params)
    try:
        missing: list[str] = []
        channel = connection.channel()
        for queue in queues:
            try:
                channel.queue_declare(queue, passive=True)
            except pika.exceptions.ChannelClosedByBroker as exc:  # and the channel is gone
                if exc.reply_code != NOT_FOUND:  # 403, 405...: not an answer about existence
                    raise refused(queue, params, exc) from exc
                missing.append(queue)
                channel = connection.channel()
        if missing:
            raise ConfigurationError(
                f"queue(s) {', '.join(missing)} do not exist in vhost {params.virtual_host!r}"
            )
    finally:
        connection.close()


def _ctl(command: Sequence[str], args: list[str], timeout: float) -> list[dict[str, Any]]:
    full = [*command, *args, "--formatter", "json", "--quiet"]
    why = "x-message-ttl is not visible through AMQP, and the management API is not used"
    try:
        done = subprocess.run(full, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RetentionUnknown(
            f"cannot read queue TTLs: running {command[0]!r} failed ({exc}); {why}; "
            "give the retention explicitly"
        ) from exc
    if done.returncode != 0:
        error = " ".join((done.stderr or done.stdout).split())[:300]
        raise RetentionUnknown(
            f"cannot read queue TTLs: {' '.join(full[:2])} exited {done.returncode} ({error}); "
            f"{why}; give the retention explicitly"
        )
    result = json.loads(done.stdout or "[]")
    return list(result) if isinstance(result, list) else []


def _arguments(raw: Any) -> dict[str, Any]:
    """rabbitmqctl's JSON arguments: [[name, type, value], ...] (3.x) or an object."""
    if isinstance(raw, dict):
        return dict(raw)
    return {item[0]: item[-1] for item in raw or [] if isinstance(item, list) and item}


def _definition(policy: Mapping[str, Any]) -> dict[str, Any]:
    definition = policy.get("definition") or {}
    parsed = json.loads(definition) if isinstance(definition, str) else definition
    return dict(parsed) if isinstance(parsed, dict) else {}


def _names(queues: Sequence[str]) -> list[str]:
    if isinstance(queues, str):
        queues = queues.split(",")
    names = [q.strip() for q in queues]
    if not names or not all(names):
        raise ConfigurationError(f"queues must be non-empty names, not {list(queues)!r}")
    return list(dict.fromkeys(names))
