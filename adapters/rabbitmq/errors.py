"""The RabbitMQ adapter's errors, rooted at consumerdedup's ConsumerDedupError."""

from __future__ import annotations

from consumerdedup import ConfigurationError, ConsumerDedupError, errors


class RabbitError(ConsumerDedupError):
    """Something on the RabbitMQ side that the adapter cannot work around."""


class BrokerUnavailable(RabbitError, errors.BrokerUnavailable):
    """Cannot reach the broker (or it refused our credentials): transient for the outbox relay."""


class TopologyError(RabbitError):
    """The queue is missing, or exists with other arguments than the ones declared."""


class PublishFailed(RabbitError):
    """The broker did not confirm a message; publish it again (downstream dedups by event_id)."""


class Unroutable(PublishFailed, errors.DestinationMissing):
    """Published with ``mandatory`` and returned: no queue is bound for it."""


class ExchangeMissing(PublishFailed, errors.DestinationMissing):
    """The exchange does not exist: the broker closed the channel with 404 NOT_FOUND."""


class PublishNacked(PublishFailed):
    """The broker refused the message (``basic.nack``) instead of confirming it."""


class BrokerRefused(RabbitError, ConfigurationError):
    """The broker answered and will not let this client in (credentials, a missing vhost,
    no access, not an AMQP port): a setup fault retrying cannot fix, charged to no event."""


class PublishRefused(PublishFailed):
    """The broker refused this message for good (over ``max_message_size``, no access to the
    exchange): publishing the same message again cannot succeed."""


class AuthenticationFailed(BrokerRefused, errors.AuthenticationFailed):
    """RabbitMQ refused the user or the password (ACCESS_REFUSED): fatal, never retried."""


class DeadLetterMissing(TopologyError, ConfigurationError):
    """The dead-letter exchange or queue does not exist (or no queue is bound for the dead
    letters) and the runner does not declare it, or declaring it again failed: a setup
    fault that stops the runner. The FAILED message stays in its queue, unacked: it comes
    again, and is dead-lettered, once the topology is fixed and the runner restarted."""
