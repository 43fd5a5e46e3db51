"""The header names every part agrees on: a message's dedup id, and why a dead letter died.

The outbox sets ``ID_HEADER`` on every event it stores; runners read it back as
the message id. A runner that dead-letters a message copies it with the
``x-dead-letter-*`` headers below, the same names whatever the broker.
"""

from __future__ import annotations

ID_HEADER = "event_id"
"""The header that carries a message's dedup id (the outbox sets it on every event)."""
REASON_HEADER = "x-dead-letter-reason"
"""On a dead letter: why the message failed (``Result.reason``)."""
CONSUMER_HEADER = "x-dead-letter-consumer"
"""On a dead letter: the consumer that refused it."""
SOURCE_HEADER = "x-dead-letter-source"
"""On a dead letter: the topic or queue it was consumed from."""
REPLAYED_HEADER = "x-replayed-from"
"""On a copy ``failed replay`` sent: the dead letter it came from (``dlq:partition:offset``
on Kafka). A Kafka runner with ``claim_ids=False`` claims the ids of a chunk holding one,
so a replay killed and run again applies nothing twice."""
DEAD_LETTER_SUFFIX = ".dlq"
"""Default dead-letter destination: the source's name plus this."""
CELERY_TASK_HEADER = "x-dead-letter-celery-task"
"""On a Celery task's dead letter: the task's name (``failed replay --celery-app`` sends it
again; a plain ``--rabbitmq`` replay keeps it in the DLQ)."""
