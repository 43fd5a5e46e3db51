"""consumer_offsets: a Kafka partition's next offset, kept in the database.

The Kafka runner's ``KafkaConfig(offsets="database")`` writes a partition's next offset
in the same transaction as the handler's effects, so the two commit together or not at
all; the owner epoch fences a consumer that lost the partition in a rebalance (the new
owner bumps it when it is assigned the partition, and every offset write is conditional on
the epoch its writer took). See adapters/kafka/offsets.py and docs/kafka.md.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, DateTime, Integer, MetaData, String, Table

from .columns import ID_LENGTH

TOPIC_LENGTH = 255
"""Kafka's topic names are at most 249 characters."""


def consumer_offsets_table(metadata: MetaData, schema: str | None, name: str) -> Table:
    """One row per (group, topic, partition) consumed with offsets in the database."""
    return Table(
        name,
        metadata,
        Column("consumer_group", String(ID_LENGTH), primary_key=True),
        Column("topic", String(TOPIC_LENGTH), primary_key=True),
        Column("partition", Integer, primary_key=True, autoincrement=False),
        # NULL: the partition was assigned (its epoch taken) before any record committed.
        Column("next_offset", BigInteger, nullable=True),
        # Bumped by each assignment of the partition: a write carrying an older one is a
        # zombie's (a consumer the group moved on from) and changes no row.
        Column("owner_epoch", BigInteger, nullable=False),
        # A chunk that held the offset before its end (a FAILED record waiting for its dead
        # letter, a RETRY) may have committed records of messages past it (those applied
        # behind a FAILED one, a chunk claimed for a repeated id): a chunk read again below
        # this offset looks its ids up. Only grows; NULL: no chunk held.
        Column("recheck_until", BigInteger, nullable=True),
        Column("updated_at", DateTime(timezone=True), nullable=False),
        schema=schema,
        mysql_engine="InnoDB",
        mysql_charset="utf8mb4",
    )
