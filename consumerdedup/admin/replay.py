"""Replaying FAILED messages from the admin page: their dead letters moved back to where
they came from, by consumerdedup.failed's own replay (the one ``failed replay`` runs),
narrowed to the records the operator chose (RabbitMQ or Kafka)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

from sqlalchemy import Engine

from ..errors import ConfigurationError
from ..failed import KAFKA_GROUP
from ..failed.report import ReplayReport
from ..failed.selection import Selection
from ..options import mapping, text
from ..schema import Tables


class DeadLetterReplay(Protocol):
    """Moves the dead letters of ``message_ids`` (FAILED for ``consumer``) back to their
    source, forgetting their FAILED records first; what it did."""

    def __call__(
        self, engine: Engine, tables: Tables, consumer: str, message_ids: Iterable[str]
    ) -> ReplayReport: ...


class RabbitMQReplay:
    """Replay through RabbitMQ: each consumer's dead-letter queue by name
    (``{"payments": "payments.dlq"}``); a consumer not named has nothing to replay."""

    def __init__(self, url: str, dead_letter_queues: Mapping[str, str]) -> None:
        self.url = text(url, "url")
        self.queues = _per_consumer(dead_letter_queues, "dead_letter_queues")

    def __repr__(self) -> str:  # never the URL: it may hold a password
        return f"RabbitMQReplay(queues={self.queues!r})"

    def __call__(
        self, engine: Engine, tables: Tables, consumer: str, message_ids: Iterable[str]
    ) -> ReplayReport:
        from ..failed import rabbitmq  # pika: the rabbitmq extra

        queue, chosen = _chosen(self.queues, consumer, message_ids, "RabbitMQReplay", "queue")
        return rabbitmq.replay(engine, self.url, queue, tables=tables, selection=chosen)


class KafkaReplay:
    """Replay through Kafka: each consumer's dead-letter topic by name
    (``{"payments": "payments.dlq"}``), read after ``group``'s committed offsets, as
    ``failed replay --kafka`` reads it. A partition's offset never passes a letter the
    page did not choose: a later replay of other records reads it again."""

    def __init__(
        self,
        bootstrap_servers: str,
        dead_letter_topics: Mapping[str, str],
        *,
        group: str = KAFKA_GROUP,
    ) -> None:
        self.bootstrap_servers = text(bootstrap_servers, "bootstrap_servers")
        self.topics = _per_consumer(dead_letter_topics, "dead_letter_topics")
        self.group = text(group, "group")

    def __repr__(self) -> str:
        return f"KafkaReplay(topics={self.topics!r}, group={self.group!r})"

    def __call__(
        self, engine: Engine, tables: Tables, consumer: str, message_ids: Iterable[str]
    ) -> ReplayReport:
        from ..failed import kafka  # aiokafka: the kafka extra

        topic, chosen = _chosen(self.topics, consumer, message_ids, "KafkaReplay", "topic")
        return kafka.replay(
            engine,
            self.bootstrap_servers,
            topic,
            tables=tables,
            group=self.group,
            selection=chosen,
        )


def _per_consumer(names: Mapping[str, str], option: str) -> dict[str, str]:
    """``names`` (consumer -> its dead-letter queue or topic), each checked where given."""
    checked = mapping(names, option)
    for consumer, name in checked.items():
        text(consumer, f"{option} key")
        text(name, f"{option}[{consumer!r}]")
    return dict(checked)


def _chosen(
    names: dict[str, str], consumer: str, message_ids: Iterable[str], owner: str, kind: str
) -> tuple[str, Selection]:
    """``consumer``'s dead-letter ``kind`` (queue, topic) and the page's choice of its
    letters; ConfigurationError naming ``owner``'s option when the consumer has none."""
    name = names.get(consumer)
    if name is None:
        raise ConfigurationError(
            f"no dead-letter {kind} for consumer {consumer!r}: name it in "
            f"{owner}(dead_letter_{kind}s=...)"
        )
    return name, Selection(consumer=consumer, message_ids=frozenset(message_ids))
