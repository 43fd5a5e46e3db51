"""What the parts of one built App share: the engines, the broker addresses, the handlers.

Made once per ``App.build()`` (so once per worker process); engines are created when a
part first needs one and disposed by ``close()``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import URL, make_url

from ..dedup.async_deduplicator import AsyncDeduplicator
from ..dedup.deduplicator import Deduplicator
from ..errors import ConfigurationError
from ..schema import Tables
from .declarations import KAFKA, ConsumerDeclaration
from .settings import Settings
from .typed_bodies import check_body_model

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from ..testing import MemoryBroker

_ASYNC_DRIVERS = {"postgresql": "postgresql+psycopg", "sqlite": "sqlite+aiosqlite"}


class Resources:
    """The database and brokers of one build, from the App's explicit values or Settings."""

    def __init__(
        self,
        settings: Settings,
        tables: Tables,
        *,
        database_url: str | None = None,
        engine: Engine | None = None,
        memory_broker: MemoryBroker | None = None,
    ) -> None:
        self.settings = settings
        self.tables = tables
        self.memory_broker = memory_broker
        self._url = database_url or settings.secret("database_url")
        self._engine = engine
        self._own_engine = engine is None
        self._async_engine: AsyncEngine | None = None

    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = create_engine(_blocking_url(self._database_url()))
        return self._engine

    def async_engine(self) -> AsyncEngine:
        if self._async_engine is None:
            from sqlalchemy.ext.asyncio import create_async_engine

            self._async_engine = create_async_engine(_async_url(self._database_url(), self))
        return self._async_engine

    def _database_url(self) -> str:
        if self._url is None:
            if self._engine is not None:
                return self._engine.url.render_as_string(hide_password=False)
            raise ConfigurationError(
                "no database: set CONSUMERDEDUP_DATABASE_URL (or give App(database_url=...))"
            )
        return self._url

    def handler(self, declaration: ConsumerDeclaration) -> Any:
        """The declared handler wrapped by a Deduplicator (or an AsyncDeduplicator, for an
        ``async def``) of the consumer's name; one a Deduplicator wrapped already, as is."""
        d = declaration
        if d.wrapped:
            return d.handler
        check_body_model(d.handler)  # a setup fault now, not every message's failure
        dedup_options = {k: v for k, v in d.dedup.items() if k != "claim_first"}
        claim_first = d.dedup.get("claim_first", True)
        if d.is_async:
            dedup: Any = AsyncDeduplicator(
                self.async_engine(), d.name, tables=self.tables, **dedup_options
            )
        else:
            dedup = Deduplicator(self.engine(), d.name, tables=self.tables, **dedup_options)
        if d.bulk:
            return dedup.bulk_handler(d.handler)
        return dedup.handler(d.handler, claim_first=claim_first)

    def kafka_bootstrap(self) -> str:
        found = self.settings.kafka_bootstrap_servers
        if not found:
            raise ConfigurationError(
                "a Kafka part needs the brokers: set CONSUMERDEDUP_KAFKA_BOOTSTRAP_SERVERS"
            )
        return found

    def rabbitmq_url(self) -> str:
        found = self.settings.secret("rabbitmq_url")
        if not found:
            raise ConfigurationError(
                "a RabbitMQ part needs its URL: set CONSUMERDEDUP_RABBITMQ_URL"
            )
        return found

    def publisher(self, to: str, options: Mapping[str, Any]) -> Any:
        """The relay's publisher: the memory broker itself, or the adapter's."""
        if self.memory_broker is not None:
            return self.memory_broker
        if to == KAFKA:
            kafka = importlib.import_module("consumerdedup.adapters.kafka")
            return kafka.KafkaPublisher(self.kafka_bootstrap(), **options)
        rabbit = importlib.import_module("consumerdedup.adapters.rabbitmq")
        return rabbit.RabbitPublisher(self.rabbitmq_url(), **options)

    def close(self) -> None:
        """Dispose of the engines this build made (not one the App was given)."""
        if self._engine is not None and self._own_engine:
            self._engine.dispose()
        if self._async_engine is not None:
            import asyncio

            asyncio.run(self._async_engine.dispose())


CONNECT_TIMEOUT = 10
"""Seconds a connection to PostgreSQL may take to open, unless the URL says
(``?connect_timeout=N``). libpq's own default is to wait for ever: a database that
accepts the connection and never answers (hung, or behind a black-holed route) held a
part's start checks for good: /readyz said nothing of why, no retry came, and a stop
signal waited the whole shutdown timeout, then exited 1."""


def _bounded(parsed: URL) -> URL:
    libpq = parsed.get_driver_name() in ("psycopg", "psycopg2", "psycopg_async")
    postgresql = parsed.get_backend_name() == "postgresql"
    if postgresql and libpq and "connect_timeout" not in parsed.query:
        return parsed.update_query_dict({"connect_timeout": str(CONNECT_TIMEOUT)})
    return parsed


def _blocking_url(url: str) -> str:
    """A bare ``postgresql://`` URL is psycopg 3's, as the CLI takes it."""
    parsed = make_url(url)
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    return _bounded(parsed).render_as_string(hide_password=False)


def _async_url(url: str, resources: Resources) -> str:
    parsed = make_url(url)
    driver = _ASYNC_DRIVERS.get(parsed.get_backend_name())
    if driver is None:
        raise ConfigurationError(
            f"an async handler on {parsed.get_backend_name()}: no async driver is known for "
            "it here; write the handler with def, not async def"
        )
    return _bounded(parsed.set(drivername=driver)).render_as_string(hide_password=False)
