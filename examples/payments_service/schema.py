"""The service's tables and consumerdedup's, created if missing (idempotent):
``python -m payments_service.schema`` with CONSUMERDEDUP_DATABASE_URL set.

No unique key on purpose: only the deduplication keeps a payment from counting twice.
"""

from __future__ import annotations

from sqlalchemy import Engine, create_engine, text

from consumerdedup import install
from consumerdedup.app.settings import Settings

from . import SCHEMA, tables


def create(engine: Engine) -> None:
    install(engine, tables)  # the schema, processed_events and outbox
    with engine.begin() as conn:
        conn.execute(
            text(
                f"CREATE TABLE IF NOT EXISTS {SCHEMA}.payments (payment_id TEXT NOT NULL, "
                "account TEXT NOT NULL, amount NUMERIC(12, 2) NOT NULL, currency TEXT NOT NULL)"
            )
        )
        conn.execute(
            text(
                f"CREATE TABLE IF NOT EXISTS {SCHEMA}.order_lines (order_id TEXT NOT NULL, "
                "sku TEXT NOT NULL, quantity INTEGER NOT NULL)"
            )
        )


if __name__ == "__main__":
    url = Settings.load().secret("database_url")
    if not url:
        raise SystemExit("set CONSUMERDEDUP_DATABASE_URL")
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    create(engine)
    print(f"tables ready in schema {SCHEMA}")
