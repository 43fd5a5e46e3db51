"""FAILED records: list them in pages, show one, forget them so a redelivery runs again,
and replay dead letters back to where they came from (``consumerdedup.failed.rabbitmq``).

For users who build their own admin page; ``consumerdedup failed ...`` is these functions
on the command line.
"""

from __future__ import annotations

from .records import MAX_LIMIT, FailedRecord, Filters, Page, forget, list_failed, show

KAFKA_GROUP = "consumerdedup-replay"
"""The consumer group whose offsets on a Kafka DLQ record how far replays have gone."""

__all__ = [
    "KAFKA_GROUP",
    "MAX_LIMIT",
    "FailedRecord",
    "Filters",
    "Page",
    "forget",
    "list_failed",
    "show",
]
