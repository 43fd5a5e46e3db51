"""The library's tables, as SQLAlchemy Core objects users can merge into Alembic.

``tables = Tables.define(metadata=my_metadata)`` adds them to your own
MetaData (so ``alembic revision --autogenerate`` sees them; the recipe is
docs/migrations.md, its helpers ``consumerdedup.migrations``);
``install(engine)`` creates them directly, idempotently: on a database that
already has everything it only reads the catalog and the version table, changes
nothing and locks none of the other tables. ``installed_version(engine)`` reads
the schema version it recorded.
"""

from ..db.catalog import SchemaLocked
from .columns import ID_LENGTH, utcnow
from .install import ddl, install, installed_version, version_rows_sql
from .notify import AFTER_INSERT_FOR_EACH_STATEMENT, NOTIFY_BODY, NOTIFY_PREFIX, notify_channel_of
from .tables import (
    DEFAULT,
    SCHEMA_VERSION,
    VERSION_TABLE,
    Tables,
    metadata,
    outbox,
    processed_events,
)

__all__ = [
    "AFTER_INSERT_FOR_EACH_STATEMENT",
    "DEFAULT",
    "ID_LENGTH",
    "NOTIFY_BODY",
    "NOTIFY_PREFIX",
    "SCHEMA_VERSION",
    "VERSION_TABLE",
    "SchemaLocked",
    "Tables",
    "ddl",
    "install",
    "installed_version",
    "metadata",
    "notify_channel_of",
    "outbox",
    "processed_events",
    "utcnow",
    "version_rows_sql",
]
