"""run_service's consumer started by hand, as a program of one's own would: the same
function, Deduplicator, RabbitConsumerRunner and config; SIGTERM stops it."""

from __future__ import annotations

import os

from run_service import BATCH_SIZE, PREFETCH, QUEUE, apply, tables
from sqlalchemy import create_engine

from consumerdedup import Deduplicator
from consumerdedup.adapters.rabbitmq import RabbitConfig, RabbitConsumerRunner

url = os.environ["CONSUMERDEDUP_DATABASE_URL"].replace("postgresql://", "postgresql+psycopg://", 1)
dedup = Deduplicator(create_engine(url), consumer="ledger", tables=tables)
runner = RabbitConsumerRunner(
    dedup.handler(apply),
    QUEUE,
    url=os.environ["CONSUMERDEDUP_RABBITMQ_URL"],
    config=RabbitConfig(batch_size=BATCH_SIZE, prefetch=PREFETCH),
)
runner.on_signals()
runner.run()
