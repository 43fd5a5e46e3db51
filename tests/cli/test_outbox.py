"""``consumerdedup outbox list|show|replay|abandon`` and the parked count of ``stats``, through
the CLI's ``main()`` in process."""

from __future__ import annotations

import getpass
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from consumerdedup import OutboxRelay
from tests.conftest import Database, database
from tests.outbox.test_outbox import FlakyPublisher, add_events, outbox_rows
from tests.outbox.test_parked import config, park_p1, published
from tests.support.cli import Cli, cli_fixture  # noqa: F401


@pytest.fixture(params=["sqlite", "postgresql", "mariadb"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    yield from database(request, request.param, tmp_path)


def test_list_show_replay_abandon_and_stats(db: Database, cli: Cli) -> None:
    ids, _ = park_p1(db)  # p1 parked, p2 held back behind it, q1 published
    more = FlakyPublisher({"r1": 99})
    [r1] = add_events(db, [("r1", "r")])
    OutboxRelay(db.engine, more, tables=db.tables, config=config(1)).drain()  # r1 parked

    stats = json.loads(cli(db, "stats", "--json").stdout)["outbox"]
    assert (stats["parked"], stats["abandoned"], stats["unpublished"]) == (2, 0, 3)
    text = cli(db, "stats").stdout
    assert "parked" in text and "abandoned" in text

    first = cli(db, "outbox", "list", "--limit", "1")
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    assert lines[0].split()[:2] == ["EVENT", "ID"]
    assert lines[1].split()[0] == ids[0] and "max_attempts=2" in lines[1]
    cursor = lines[-1].removeprefix("next page: --after ")
    second = json.loads(cli(db, "outbox", "list", "--json", "--after", cursor).stdout)
    assert [e["event_id"] for e in second["events"]] == [r1]
    assert second["next_cursor"] is None and second["events"][0]["state"] == "parked"
    assert cli(db, "outbox", "list", "--after", "nonsense").returncode == 2
    assert cli(db, "outbox", "list", "--limit", "0").returncode == 2
    shown = json.loads(cli(db, "outbox", "show", ids[0], "--json").stdout)
    assert (shown["state"], shown["body"], shown["attempts"]) == ("parked", "p1", 2)
    assert cli(db, "outbox", "show", "nope").returncode == 1

    dry = cli(db, "outbox", "replay", r1, ids[2], "--dry-run")
    assert f"would replay 1 parked event(s): {r1}" in dry.stdout, dry.stdout
    assert (
        f"1 id(s) not parked (pending, published, abandoned or unknown), left alone: {ids[2]}"
        in (dry.stdout)
    )
    refused = cli(db, "outbox", "replay", r1, stdin="n\n")
    assert refused.returncode == 1 and "not confirmed" in refused.stderr
    assert cli(db, "outbox", "replay").returncode == 2  # IDs or --all
    done = cli(db, "outbox", "replay", "--all", stdin="y\n")
    assert f"replayed 2 parked event(s): {ids[0]}, {r1}" in done.stdout, done.stdout

    # p1 fails again: parked again by a relay with max_attempts=1; then abandoned.
    again = FlakyPublisher({"p1": 99})
    relay = OutboxRelay(db.engine, again, tables=db.tables, config=config(1))
    relay.drain()
    assert published(again) == ["r1"] and relay.parked() == [(ids[0], "ValueError: refused p1")]
    assert cli(db, "outbox", "abandon", ids[0], "--yes").returncode == 2  # --reason required
    dry = cli(db, "outbox", "abandon", ids[0], "--reason", "bad sku", "--dry-run")
    assert f"would abandon 1 parked event(s) as {getpass.getuser()!r}: {ids[0]}" in dry.stdout
    gone = cli(db, "outbox", "abandon", ids[0], "--reason", "bad sku", "--by", "ana", "--yes")
    assert f"abandoned 1 parked event(s) as 'ana': {ids[0]}" in gone.stdout, gone.stdout
    row = next(r for r in outbox_rows(db) if r.body == b"p1")
    assert (row.abandoned_by, row.abandoned_reason) == ("ana", "bad sku")
    listed = cli(db, "outbox", "list", "--abandoned").stdout
    assert ids[0] in listed and "ana: bad sku" in listed
    assert "no parked outbox events" in cli(db, "outbox", "list").stdout
    relay.drain()
    assert published(again) == ["r1", "p2"]  # the key released; p1 never goes out
    by_default = cli(db, "outbox", "abandon", ids[0], "--reason", "x", "--yes")
    assert "abandoned 0 parked event(s)" in by_default.stdout  # abandoned already: left alone
    stats = json.loads(cli(db, "stats", "--json").stdout)["outbox"]
    assert (stats["parked"], stats["abandoned"], stats["unpublished"]) == (0, 1, 0)


def test_an_outbox_from_an_older_release_says_run_init_db(db: Database, cli: Cli) -> None:
    outbox = db.tables.outbox.fullname
    with db.engine.begin() as conn:
        for column in ("parked_at", "abandoned_by"):
            conn.execute(text(f"ALTER TABLE {outbox} DROP COLUMN {column}"))
    for args in (("stats",), ("outbox", "list")):
        old = cli(db, *args)
        assert old.returncode == 1, old.stdout
        assert "lacks column(s) parked_at, abandoned_by" in old.stderr
        assert "init-db" in old.stderr
    assert cli(db, "init-db").returncode == 0
    assert cli(db, "outbox", "list").stdout == "no parked outbox events\n"
