"""How long Kafka can deliver a topic's records again: ``retention.ms`` read with the admin client.

A record leaves the log with its segment, and a segment is deleted only once
its newest record is older than retention.ms; the segment stays open for up
to ``segment.ms``. So a record can be read again up to retention.ms +
segment.ms after it was written, and that sum is the window reported (when
the broker reports segment.ms). ``retention.ms=-1`` and compact-only topics
keep records forever: their consumers are never pruned.

Brokers that report no ``retention.ms`` for a topic (Tansu returns no
config entries for topics created without explicit configs) get
``RetentionUnknown``: the window must then be given explicitly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient  # type: ignore[import-untyped]
from aiokafka.admin.config_resource import (  # type: ignore[import-untyped]
    ConfigResource,
    ConfigResourceType,
)

from consumerdedup.errors import ConfigurationError
from consumerdedup.event_loop import run_blocking
from consumerdedup.prune.windows import LONGEST, BrokerRetention, RetentionUnknown, SourceRetention

RETENTION_MS = "retention.ms"
SEGMENT_MS = "segment.ms"
CLEANUP_POLICY = "cleanup.policy"


def topic_retention(topic: str, configs: Mapping[str, str | None]) -> SourceRetention | None:
    """The window one topic's configs give; None when they do not say."""
    policy = configs.get(CLEANUP_POLICY) or "delete"
    if "delete" not in [p.strip() for p in policy.split(",")]:
        why = f"{CLEANUP_POLICY}={policy}: compaction keeps each key's latest record indefinitely"
        return SourceRetention(topic, None, why)
    raw = configs.get(RETENTION_MS)
    if raw is None:
        return None
    retention = int(raw)
    if retention < 0:
        return SourceRetention(topic, None, f"{RETENTION_MS}={raw}: kept forever")
    segment_raw = configs.get(SEGMENT_MS)
    segment = int(segment_raw) if segment_raw is not None else 0
    detail = f"{RETENTION_MS}={raw}"
    detail += f" + {SEGMENT_MS}={segment_raw}" if segment > 0 else f", {SEGMENT_MS} not reported"
    total_ms = retention + max(segment, 0)
    if total_ms > LONGEST // timedelta(milliseconds=1):  # Long.MAX_VALUE and friends
        return SourceRetention(topic, None, f"{detail}: over a century, taken as forever")
    return SourceRetention(topic, timedelta(milliseconds=total_ms), detail)


async def read_kafka_retention(
    bootstrap: str,
    topics: Sequence[str],
    *,
    client_options: Mapping[str, Any] | None = None,
    timeout: float = 30.0,
) -> BrokerRetention:
    """Ask the broker for every topic's configs; raise RetentionUnknown if one does not say."""
    names = _topics(topics)
    return await asyncio.wait_for(_read(bootstrap, names, dict(client_options or {})), timeout)


def kafka_retention(
    bootstrap: str,
    topics: Sequence[str],
    *,
    client_options: Mapping[str, Any] | None = None,
    timeout: float = 30.0,
) -> BrokerRetention:
    """``read_kafka_retention`` for blocking code (runs its own event loop; a
    ConfigurationError inside a running one)."""
    return run_blocking(
        lambda: read_kafka_retention(
            bootstrap, topics, client_options=client_options, timeout=timeout
        ),
        "kafka_retention()",
        "read_kafka_retention(...)",
    )


async def _read(bootstrap: str, topics: list[str], options: dict[str, Any]) -> BrokerRetention:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **options)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        if missing := [t for t in topics if t not in existing]:
            raise ConfigurationError(
                f"topic(s) {', '.join(missing)} do not exist on the Kafka broker at {bootstrap}"
            )
        # All configs, never a chosen few: Tansu drops the connection on a filtered request.
        resources = [ConfigResource(ConfigResourceType.TOPIC, t) for t in topics]
        responses = await admin.describe_configs(resources)
    finally:
        await admin.close()
    configs = _configs(responses)
    found = {t: topic_retention(t, configs.get(t, {})) for t in topics}
    if silent := [t for t, retention in found.items() if retention is None]:
        raise RetentionUnknown(
            f"the Kafka broker at {bootstrap} reports no {RETENTION_MS} for topic(s) "
            f"{', '.join(silent)} (some Kafka-protocol brokers, Tansu among them, report only "
            "configs set explicitly on a topic), so the retention must be given explicitly"
        )
    return BrokerRetention.of(f"kafka {bootstrap}", (r for r in found.values() if r is not None))


def _configs(responses: Sequence[Any]) -> dict[str, dict[str, str | None]]:
    """topic -> {name: value} from DescribeConfigs responses of any version."""
    found: dict[str, dict[str, str | None]] = {}
    for response in responses:
        for error_code, error_message, _type, name, entries, *_ in response.resources:
            if error_code:
                raise RetentionUnknown(
                    f"the Kafka broker would not describe topic {name!r}: "
                    f"error {error_code} {error_message or ''}".strip()
                )
            found[name] = {entry[0]: entry[1] for entry in entries}
    return found


def _topics(topics: Sequence[str]) -> list[str]:
    if isinstance(topics, str):
        topics = topics.split(",")
    names = [t.strip() for t in topics]
    if not names or not all(names):
        raise ConfigurationError(f"topics must be non-empty names, not {list(topics)!r}")
    return list(dict.fromkeys(names))
