"""``consumerdedup doctor``'s lock-table line on the shared PostgreSQL: read-only (it asks
the server's settings), so any relay count and batch size can be checked against it."""

from __future__ import annotations

import pytest

from consumerdedup.cli.main import main
from tests.cli.test_doctor import doctor, line
from tests.conftest import Database


def settings(pg: Database) -> tuple[int, int, int]:
    with pg.engine.connect() as conn:
        row = conn.exec_driver_sql(
            "SELECT current_setting('max_locks_per_transaction')::int, "
            "current_setting('max_connections')::int, "
            "current_setting('max_prepared_transactions')::int"
        ).one()
    return row[0], row[1], row[2]


def test_the_default_relay_fits_the_lock_table(
    pg: Database, capsys: pytest.CaptureFixture[str]
) -> None:
    locks, connections, prepared = settings(pg)
    code, out = doctor(pg, capsys)
    assert code == 0, out
    said = line(out, "lock table")
    assert said.split()[0] == "ok", out
    assert "1 relay(s) x (batch_size 100 + 16) = up to 116 locks" in said
    assert f"max_locks_per_transaction={locks}" in said
    assert f"= {locks * (connections + prepared):,} shared lock slots: within half" in said


def test_relays_that_could_take_half_the_lock_table_are_warned_with_both_fixes(
    pg: Database, capsys: pytest.CaptureFixture[str]
) -> None:
    locks, connections, prepared = settings(pg)
    capacity = locks * (connections + prepared)
    relays, batch = 4, capacity // 4  # 4 x (capacity/4 + 16): over half the table
    code, out = doctor(pg, capsys, "--relays", str(relays), "--relay-batch-size", str(batch))
    said = line(out, "lock table")
    assert said.split()[0] == "warn", out
    assert code == 0  # a warn is worth a look, not a failed deployment
    largest = capacity // 2 // relays - 16
    assert f"lower the relays' batch_size to {largest} or less" in said
    assert "raise max_locks_per_transaction to" in said and "(a restart)" in said
    assert "publish_window does not matter" in said


@pytest.mark.parametrize("args", [["--relays", "0"], ["--relay-batch-size", "0"]])
def test_a_relay_count_or_batch_below_one_is_a_usage_error(
    pg: Database, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    assert main(["--db", pg.url, "doctor", *args]) == 2
    assert "must be >= 1" in capsys.readouterr().err
