"""The Kafka adapter's errors, in the consumerdedup tree."""

from __future__ import annotations

from consumerdedup import ConfigurationError, ConsumerDedupError, errors


class KafkaAdapterError(ConsumerDedupError):
    """Root of what this adapter raises on purpose."""


class PublishFailed(KafkaAdapterError):
    """The broker did not acknowledge a record (the aiokafka error is the ``__cause__``)."""


class BrokerUnavailable(PublishFailed, errors.BrokerUnavailable):
    """The broker could not be reached or timed out: transient, so the outbox relay backs
    off without charging the event an attempt."""


class TopicMissing(PublishFailed, errors.DestinationMissing):
    """The broker answers but has no such topic and does not create it: the outbox relay
    charges the event an attempt and backs it off, holding back only its key."""


class BrokerRefused(KafkaAdapterError, ConfigurationError):
    """The broker answered and will not let this client start (idempotence it does not grant,
    credentials, ACLs): a setup fault retrying cannot fix, charged to no event."""


class PublishRefused(PublishFailed):
    """The broker (or the client) refused this record for good (too large, no right to the
    topic, invalid): sending the same record again cannot succeed."""


class TopicRefused(PublishRefused):
    """The broker refuses the topic itself (an invalid name, a topic policy): no record can
    ever be sent to it."""


class AuthenticationFailed(BrokerRefused, errors.AuthenticationFailed):
    """The broker refused the SASL credentials (or the mechanism): fatal, never retried."""


class DeadLetterMissing(KafkaAdapterError, ConfigurationError):
    """The dead-letter topic does not exist and the broker will not create it (auto-create
    off, no right to create topics, a name it refuses): a setup fault that stops the runner.
    The FAILED record's offset is not committed: it is read again, and dead-lettered, once
    the topic exists and the runner is restarted."""
