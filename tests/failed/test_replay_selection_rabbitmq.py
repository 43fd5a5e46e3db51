"""``failed replay`` picks a subset on RabbitMQ (issue 38, item 10): ``--consumer``,
``--reason``, ``--error-type``, ``--since``/``--until`` (by the FAILED record's time),
``--dry-run`` counting what they take; the summary counts the letters replayed without any
record, and the exit code tells all done (0), partly done (3) and nothing done (1) apart."""

from __future__ import annotations

from datetime import timedelta

import pytest

from consumerdedup.failed import forget
from tests.conftest import Database
from tests.failed.shop import IDS, RabbitShop
from tests.failed.test_records import NOW, add
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401

MAIL = ["mail-1", "mail-2"]


@pytest.fixture
def shop(pg: Database, rabbit: Broker) -> RabbitShop:
    """The shop's five orders FAILED (KeyError) and dead-lettered, order-5's record since
    forgotten; and two letters of another consumer (ValueError, failed 3 days ago)."""
    shop = RabbitShop(pg, rabbit)
    shop.consume()
    assert shop.outcomes() == dict.fromkeys(IDS, "failed")
    assert forget(pg.engine, "shop", ["order-5"], tables=pg.tables) == ["order-5"]
    shop.mail_queue = rabbit.queue("mail")  # type: ignore[attr-defined]
    add(pg, "mail", MAIL, error="ValueError: bad address", at=NOW - timedelta(days=3))
    for message_id in MAIL:
        headers = {
            "x-dead-letter-consumer": "mail",
            "x-dead-letter-reason": "ValueError: bad address",
            "x-dead-letter-source": shop.mail_queue,  # type: ignore[attr-defined]
        }
        rabbit.publish(shop.queue + ".dlq", b"{}", message_id, headers=headers)
    assert rabbit.ready(shop.queue + ".dlq") == 7
    return shop


def summary(done: object) -> str:
    return str(getattr(done, "stdout", "")).splitlines()[-1]


def test_filters_pick_a_subset_and_dry_run_counts_it(shop: RabbitShop) -> None:
    dlq = shop.queue + ".dlq"
    cases = {
        ("--error-type", "KeyError"): (5, 1, 2),
        ("--error-type", "Key"): (0, 0, 7),  # the whole type name, not a prefix
        ("--reason", "BAD ADDRESS"): (2, 0, 5),
        ("--consumer", "mail"): (2, 0, 5),
        ("--since", "1d"): (4, 0, 3),  # order-5 has no record, so no time: not taken
        ("--until", "1d"): (2, 0, 5),
        ("--consumer", "shop", "--until", "1d"): (0, 0, 7),
    }
    for options, (replayed, unrecorded, skipped) in cases.items():
        done = shop.run(*shop.replay_args(), *options, "--dry-run")
        assert done.returncode == 0, (options, done.stderr)
        line = summary(done)
        assert line.startswith(f"would replay {replayed} dead letter(s)"), (options, line)
        assert f"({unrecorded} without any record)" in line, (options, line)
        if skipped:
            assert f"{skipped} not selected by the filters" in line, (options, line)
    assert shop.rabbit.ready(dlq) == 7 and shop.rabbit.ready(shop.queue) == 0
    assert shop.outcomes() == {**dict.fromkeys(IDS[:4], "failed"), **dict.fromkeys(MAIL, "failed")}


def test_a_subset_replayed_and_the_exit_codes(shop: RabbitShop) -> None:
    dlq, mail_queue = shop.queue + ".dlq", shop.mail_queue  # type: ignore[attr-defined]
    done = shop.run(*shop.replay_args(), "--consumer", "mail", "--yes")
    assert done.returncode == 0, done.stderr
    assert (
        summary(done).startswith("replayed 2 dead letter(s)") and "forgot 2 FAILED" in done.stdout
    )
    assert shop.rabbit.ready(mail_queue) == 2 and shop.rabbit.ready(dlq) == 5
    assert [p.message_id for p, _ in shop.rabbit.peek(dlq)] == IDS  # in their places

    shop.field = "item"  # the fix
    partly = shop.run(*shop.replay_args(), "--only-recorded", "--yes")
    assert partly.returncode == 3, (partly.stdout, partly.stderr)
    assert "kept in" in partly.stdout and "order-5: no record of it" in partly.stdout
    assert summary(partly).startswith("replayed 4 dead letter(s)") and "1 kept" in partly.stdout
    assert shop.rabbit.ready(dlq) == 1

    nothing = shop.run(*shop.replay_args(), "--only-recorded", "--yes")
    assert nothing.returncode == 1, (nothing.stdout, nothing.stderr)
    assert summary(nothing).startswith("replayed 0 dead letter(s)")

    rest = shop.run(*shop.replay_args(), "--yes")
    assert rest.returncode == 0, rest.stderr
    assert "1 dead letter(s) with no record at all" in rest.stdout and "order-5" in rest.stdout
    assert "(1 without any record)" in summary(rest)
    assert shop.rabbit.ready(dlq) == 0
    shop.consume()
    assert shop.applied() == IDS


def test_bad_filters_are_usage_errors(shop: RabbitShop) -> None:
    for options in (["--since", "yesterday"], ["--error-type", " "], ["--reason", ""]):
        done = shop.run(*shop.replay_args(), *options, "--dry-run")
        assert done.returncode == 2, (options, done.stderr)
        assert "Traceback" not in done.stderr
