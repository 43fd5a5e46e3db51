"""The aiokafka clients, made from our settings plus pass-through options.

What the guarantees depend on (the group, auto-commit off, acks=all, idempotence)
is set here and refused in the options, before anything connects.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer  # type: ignore[import-untyped]

from consumerdedup import ConfigurationError

RUNNER_OWNED = {"bootstrap_servers", "group_id", "enable_auto_commit"}
PUBLISHER_OWNED = {"bootstrap_servers", "acks", "enable_idempotence"}


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
