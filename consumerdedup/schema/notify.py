"""The outbox's NOTIFY trigger (PostgreSQL): its SQL, its names and its channel.

A statement-level trigger NOTIFYs relays on insert. NOTIFY is delivered at commit,
so a relay wakes exactly when new rows become visible; a rolled-back insert wakes
nobody. ``install()`` sends only the statements that something missing or different
needs; ``trigger_ddl`` replaces whatever is there (for a migration or ``--sql``).
"""

from __future__ import annotations

from sqlalchemy import Table

NOTIFY_PREFIX = "consumerdedup_"
"""Of the PostgreSQL NOTIFY channels that wake outbox relays."""

# By the table's OID, as the relay's locks: every spelling of one table (with or without
# its schema) is one channel, and two outboxes are two. install() compares it with pg_proc.
NOTIFY_BODY = (
    f" BEGIN PERFORM pg_notify('{NOTIFY_PREFIX}' || TG_RELID::text, ''); RETURN NULL; END "
)
AFTER_INSERT_FOR_EACH_STATEMENT = 4
"""pg_trigger.tgtype of our trigger: TRIGGER_TYPE_INSERT, neither ROW nor BEFORE."""


def notify_channel_of(oid: int) -> str:
    """The NOTIFY channel the outbox trigger wakes relays on: the table's OID, resolved."""
    return f"{NOTIFY_PREFIX}{oid}"


def legacy_channel(outbox: Table) -> str:
    """The channel of triggers installed by earlier releases, named by how the table was
    spelled (``public.outbox`` and ``outbox`` differed)."""
    return f"{NOTIFY_PREFIX}{outbox.fullname.replace('.', '_')}"[:63]


def trigger_names(outbox: Table) -> tuple[str, str]:
    """The trigger and its function, unquoted (the function in the outbox's schema; in
    the current schema when the outbox has none)."""
    name = f"{outbox.name}_notify"[:63]
    return name, name


def trigger_ddl(outbox: Table) -> list[str]:
    """The function, then the trigger dropped and made again."""
    return [function_sql(outbox), drop_trigger_sql(outbox), create_trigger_sql(outbox)]


def function_sql(outbox: Table) -> str:
    return (
        f"CREATE OR REPLACE FUNCTION {_function(outbox)}() RETURNS trigger "
        f"LANGUAGE plpgsql AS $${NOTIFY_BODY}$$"
    )


def drop_trigger_sql(outbox: Table) -> str:
    return f'DROP TRIGGER IF EXISTS "{trigger_names(outbox)[0]}" ON {_table(outbox)}'


def create_trigger_sql(outbox: Table) -> str:
    return (
        f'CREATE TRIGGER "{trigger_names(outbox)[0]}" AFTER INSERT ON {_table(outbox)} '
        f"FOR EACH STATEMENT EXECUTE FUNCTION {_function(outbox)}()"
    )


def drop_function_sql(outbox: Table) -> str:
    return f"DROP FUNCTION IF EXISTS {_function(outbox)}()"


def _table(outbox: Table) -> str:
    return f'"{outbox.schema}"."{outbox.name}"' if outbox.schema else f'"{outbox.name}"'


def _function(outbox: Table) -> str:
    function = trigger_names(outbox)[1]
    return f'"{outbox.schema}"."{function}"' if outbox.schema else f'"{function}"'
