"""The RabbitMQ adapter's errors, rooted at consumerdedup's ConsumerDedupError."""

from __future__ import annotations

from consumerdedup import ConsumerDedupError


class RabbitError(ConsumerDedupError):
    """Something on the RabbitMQ side that the adapter cannot work around."""


class BrokerUnavailable(RabbitError, ConnectionError):
    """Cannot reach the broker (or it refused our credentials): transient for the outbox relay."""


class TopologyError(RabbitError):
    """The queue is missing, or exists with other arguments than the ones declared."""


class PublishFailed(RabbitError):
    """The broker did not confirm a message; publish it again (downstream dedups by event_id)."""


class Unroutable(PublishFailed):
    """Published with ``mandatory`` and returned: no queue is bound for it."""


class PublishNacked(PublishFailed):
    """The broker refused the message (``basic.nack``) instead of confirming it."""
