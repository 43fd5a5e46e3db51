"""The failure table of dedup/states.py: the one in code is the one its docstring shows."""

from __future__ import annotations

import re

from consumerdedup.dedup import states
from consumerdedup.dedup.states import ON_FAILURE, Next, round_budget
from consumerdedup.retry import ErrorKind

ROW = re.compile(r"^\s+(PERMANENT|UNKNOWN|TRANSIENT)\s+(running|FAILING)\s+(\w+)\s+(\w+)\s*$")


def test_the_docstring_table_is_the_table_in_code() -> None:
    documented = {}
    for line in (states.__doc__ or "").splitlines():
        row = ROW.match(line)
        if row:
            kind, state, left, used_up = row.groups()
            key = (ErrorKind[kind], state == "FAILING")
            documented[key] = (Next[left], Next[used_up])
    assert documented == ON_FAILURE


def test_every_kind_and_state_has_a_rule() -> None:
    assert set(ON_FAILURE) == {(kind, failing) for kind in ErrorKind for failing in (False, True)}


def test_a_permanent_error_never_retries_and_a_transient_one_never_fails() -> None:
    for (kind, _failing), steps in ON_FAILURE.items():
        if kind is ErrorKind.PERMANENT:
            assert Next.RETRY not in steps
        if kind is ErrorKind.TRANSIENT:
            assert Next.FAILING not in steps and Next.UNRECORDED not in steps


def test_the_round_budget_grows_with_the_batch_and_the_attempts() -> None:
    assert round_budget(1, 4) == 1 * (4 + 3 + 2 * 1) + 16
    assert round_budget(100, 4) > round_budget(10, 4) > round_budget(1, 4)
    assert round_budget(10, 8) > round_budget(10, 4)
