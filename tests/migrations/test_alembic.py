"""The Alembic recipe of docs/migrations.md, run with Alembic itself against PostgreSQL.

Each test makes a temporary Alembic project (``alembic init``) whose models
module defines an ``orders`` table and consumerdedup's tables in a schema of
the test's own (dropped after), then runs the ``alembic`` command line as a
user would: ``revision --autogenerate``, the helper calls added to the
generated migration as the recipe says, ``upgrade head``, ``check`` (nothing
left to generate), ``downgrade base``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, inspect, text

from consumerdedup import Tables, install
from consumerdedup.schema import SCHEMA_VERSION, installed_version
from tests.core.test_install import Statements, outbox_row

pytest.importorskip("alembic")

ROOT = Path(__file__).resolve().parents[2]

ENV = """
from alembic import context

from consumerdedup import migrations
from models import APART, SCHEMA, TABLES, URL, metadata

from sqlalchemy import create_engine


def include_name(name, type_, parent_names):
    # Only this project's schema: the database holds other tests' schemas too.
    return name == SCHEMA if type_ == "schema" else True


engine = create_engine(URL)
with engine.connect() as connection:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        include_schemas=True,
        include_name=include_name,
        include_object=migrations.include_object(TABLES, ours=not APART),
        render_item=migrations.render_item,
        version_table_schema=SCHEMA,
    )
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
"""

MODELS = """
from sqlalchemy import Column, Integer, MetaData, String, Table

from consumerdedup import Tables

URL = {url!r}
SCHEMA = {schema!r}
APART = {apart!r}

metadata = MetaData()
orders = Table(
    "orders", metadata, Column("id", Integer, primary_key=True), Column("note", String(20)),
    schema=SCHEMA,
)
# Together: consumerdedup's tables on the app's MetaData. Apart: on a MetaData of their own.
TABLES = Tables.define(
    f"{{SCHEMA}}.processed_events",
    f"{{SCHEMA}}.outbox",
    metadata=None if APART else metadata,
    partitioned={partitioned!r},
)
"""

# What docs/migrations.md tells a user to add to the generated migration.
HEADER = "from consumerdedup import migrations\nfrom models import TABLES\n"
FIRST_IN_UPGRADE = "    migrations.create_schemas(op.get_bind(), TABLES)\n"
LAST_IN_UPGRADE = "    migrations.upgrade_extras(op.get_bind(), TABLES)\n"
FIRST_IN_DOWNGRADE = "    migrations.downgrade_extras(op.get_bind(), TABLES)\n"


@dataclass
class Project:
    path: Path
    schema: str
    engine: Engine
    tables: Tables

    def alembic(self, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PYTHONPATH": f"{self.path}{os.pathsep}{ROOT}"}
        done = subprocess.run(
            [sys.executable, "-m", "alembic", "-c", str(self.path / "alembic.ini"), *args],
            cwd=self.path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if ok:
            assert done.returncode == 0, done.stdout + done.stderr
        return done

    def revision(self, recipe: bool) -> str:
        self.alembic("revision", "--autogenerate", "-m", "initial")
        [script] = (self.path / "migrations" / "versions").glob("*.py")
        source = script.read_text()
        if recipe:
            source = add_recipe(source)
        script.write_text(source)
        return source

    def tables_in_schema(self) -> set[str]:
        with self.engine.connect() as conn:
            return set(inspect(conn).get_table_names(schema=self.schema))


def add_recipe(source: str) -> str:
    """The generated migration, with the recipe's helper calls where it says."""
    source = source.replace("import sqlalchemy as sa\n", "import sqlalchemy as sa\n" + HEADER, 1)
    upgrade, downgrade = source.split("def downgrade() -> None:\n")
    head, body = upgrade.split("def upgrade() -> None:\n")
    end = "    # ### end Alembic commands ###"
    body = FIRST_IN_UPGRADE + body.replace(end, LAST_IN_UPGRADE + end, 1)
    downgrade = FIRST_IN_DOWNGRADE + downgrade
    return f"{head}def upgrade() -> None:\n{body}def downgrade() -> None:\n{downgrade}"


@pytest.fixture
def engine(postgres_url: str) -> Iterator[Engine]:
    engine = create_engine(postgres_url)
    yield engine
    engine.dispose()


def make_project(
    tmp_path: Path, engine: Engine, postgres_url: str, *, apart: bool, partitioned: bool
) -> Iterator[Project]:
    schema = f"m_{uuid.uuid4().hex[:12]}"
    path = tmp_path / "app"
    path.mkdir()
    tables = Tables.define(
        f"{schema}.processed_events", f"{schema}.outbox", partitioned=partitioned
    )
    project = Project(path, schema, engine, tables)
    try:
        project.alembic("init", str(path / "migrations"))
        (path / "migrations" / "env.py").write_text(ENV)
        (path / "models.py").write_text(
            textwrap.dedent(
                MODELS.format(url=postgres_url, schema=schema, apart=apart, partitioned=partitioned)
            )
        )
        with engine.begin() as conn:  # the app's schema exists; ours are made by the recipe
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        yield project
    finally:
        with engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))


@pytest.fixture(params=[False, True], ids=["plain", "partitioned"])
def together(
    request: pytest.FixtureRequest, tmp_path: Path, engine: Engine, postgres_url: str
) -> Iterator[Project]:
    yield from make_project(tmp_path, engine, postgres_url, apart=False, partitioned=request.param)


@pytest.fixture
def apart(tmp_path: Path, engine: Engine, postgres_url: str) -> Iterator[Project]:
    yield from make_project(tmp_path, engine, postgres_url, apart=True, partitioned=True)


def test_together_autogenerate_upgrade_check_downgrade(together: Project) -> None:
    project, tables = together, together.tables
    source = project.revision(recipe=True)
    for table in tables.owned:
        assert f"op.create_table('{table.name}'" in source
    if tables.partitioned:
        assert "postgresql_partition_by='RANGE (processed_at)'" in source

    project.alembic("upgrade", "head")
    assert project.tables_in_schema() >= {"orders", *(t.name for t in tables.owned)}
    assert installed_version(project.engine, tables) == SCHEMA_VERSION
    with project.engine.connect() as conn:
        trigger = conn.execute(
            text("SELECT tgtype FROM pg_trigger WHERE tgrelid = to_regclass(:t)"),
            {"t": tables.outbox.fullname},
        ).scalar()
        partitions = conn.execute(
            text("SELECT count(*) FROM pg_inherits WHERE inhparent = to_regclass(:t)"),
            {"t": tables.processed_events.fullname},
        ).scalar()
    assert trigger == 4  # AFTER INSERT FOR EACH STATEMENT
    assert partitions == (10 if tables.partitioned else 0)  # DEFAULT + yesterday..7 ahead
    # What the migration made is what install() expects: it only reads.
    with Statements(project.engine) as statements:
        install(project.engine, tables)
    assert statements.changes() == []
    # Nothing left for autogenerate: not the trigger, not the partitions.
    check = project.alembic("check")
    assert "No new upgrade operations detected" in check.stdout + check.stderr
    with project.engine.begin() as conn:
        conn.execute(tables.outbox.insert(), outbox_row("e-1"))

    project.alembic("downgrade", "base")
    assert project.tables_in_schema() == {"alembic_version"}
    with project.engine.connect() as conn:
        functions = conn.execute(
            text(
                "SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
                "WHERE n.nspname = :s"
            ),
            {"s": project.schema},
        ).scalar()
    assert functions == 0


def test_apart_autogenerate_never_touches_our_tables(apart: Project) -> None:
    project, tables = apart, apart.tables
    install(project.engine, tables)  # consumerdedup's tables, managed by install()
    ours = {t.name for t in tables.owned}
    before = project.tables_in_schema()
    assert len(before - ours) == 10  # the partitions: DEFAULT + yesterday..7 days ahead

    source = project.revision(recipe=False)
    assert "op.create_table('orders'" in source
    for name in before:
        assert f"'{name}'" not in source  # no drop_table, drop_index, alter of ours
    project.alembic("upgrade", "head")
    check = project.alembic("check")
    assert "No new upgrade operations detected" in check.stdout + check.stderr
    project.alembic("downgrade", "base")
    assert project.tables_in_schema() == before | {"alembic_version"}
    assert installed_version(project.engine, tables) == SCHEMA_VERSION


@pytest.fixture
def together_partitioned(tmp_path: Path, engine: Engine, postgres_url: str) -> Iterator[Project]:
    yield from make_project(tmp_path, engine, postgres_url, apart=False, partitioned=True)


def test_without_include_object_autogenerate_would_drop_the_partitions(
    together_partitioned: Project,
) -> None:
    """Why the recipe needs include_object even when the tables are on your MetaData."""
    together = together_partitioned
    env = together.path / "migrations" / "env.py"
    env.write_text(env.read_text().replace("include_object=", "# include_object="))
    together.revision(recipe=True)
    together.alembic("upgrade", "head")
    check = together.alembic("check", ok=False)
    assert check.returncode != 0
    assert "remove_table" in check.stdout + check.stderr
