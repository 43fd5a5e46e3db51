"""consumerdedup.options: each validator takes its one accepted form, refuses the rest with a
ConfigurationError naming the option, what was given and what is expected."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest

from consumerdedup.errors import ConfigurationError
from consumerdedup.options import (
    boolean,
    choice,
    duration,
    function,
    functions,
    instance,
    integer,
    kinds,
    mapping,
    matching,
    maybe,
    names,
    number,
    refuse,
    text,
)


def refused(call: object, *, said: str) -> str:
    assert callable(call)
    with pytest.raises(ConfigurationError) as caught:
        call()
    assert said in str(caught.value), str(caught.value)
    assert isinstance(caught.value, ValueError)  # configuration errors are ValueErrors too
    return str(caught.value)


def test_boolean_takes_only_true_and_false() -> None:
    assert boolean(False, "X.flag") is False
    for value in ("false", "no", 0, 1, None):
        refused(lambda v=value: boolean(v, "X.flag"), said="X.flag: expected True or False")


def test_integer_refuses_bools_floats_and_strings_and_checks_bounds() -> None:
    assert integer(3, "X.n", at_least=1, at_most=3) == 3
    for value in (True, 1.5, "100", None):
        refused(lambda v=value: integer(v, "X.n"), said=f"({type(value).__name__})")
    said = refused(lambda: integer(0, "X.n", at_least=1), said="X.n: expected an integer >= 1")
    assert "got 0 (int)" in said
    refused(lambda: integer(9, "X.n", at_least=1, at_most=5), said="from 1 to 5")


def test_number_is_finite_and_never_a_bool() -> None:
    assert number(1, "X.r", at_least=0) == 1.0
    for value in (True, "0.5", float("nan"), float("inf"), -1):
        refused(lambda v=value: number(v, "X.r", at_least=0), said="X.r: expected a finite number")


def test_duration_takes_seconds_only_where_documented() -> None:
    assert duration(timedelta(seconds=2), "X.d") == timedelta(seconds=2)
    refused(lambda: duration(5, "X.d"), said="X.d: expected a timedelta > 0, got 5 (int)")
    assert duration(1.5, "X.d", seconds=True) == timedelta(seconds=1.5)
    refused(lambda: duration(True, "X.d", seconds=True), said="(bool)")
    refused(lambda: duration(float("inf"), "X.d", seconds=True), said="X.d")
    refused(lambda: duration(1e30, "X.d", seconds=True), said="X.d")
    refused(lambda: duration(timedelta(0), "X.d"), said="> 0")
    assert duration(timedelta(0), "X.d", zero=True) == timedelta(0)
    refused(lambda: duration(timedelta(-1), "X.d", zero=True), said=">= 0:00:00")
    floor = timedelta(seconds=1)
    refused(lambda: duration(timedelta(milliseconds=1), "X.d", at_least=floor), said=">= 0:00:01")
    refused(lambda: duration(timedelta(hours=2), "X.d", at_most=timedelta(hours=1)), said="<= 1:00")


def test_text_is_a_str_without_nul_and_bounded() -> None:
    assert text("a", "X.s") == "a"
    assert text("", "X.s", empty=True) == ""
    for value in (b"a", 5, None, "a\x00b", "", "  "):
        refused(lambda v=value: text(v, "X.s"), said="X.s: expected a")
    refused(lambda: text("abcd", "X.s", max_length=3), said="at most 3 characters")


def test_a_string_is_one_name_never_its_characters() -> None:
    assert names("payments", "X.names") == ("payments",)
    assert names(["a", "b"], "X.names") == ("a", "b")
    assert names((n for n in ["a"]), "X.names") == ("a",)
    for value in ({"a": 1}, b"ab", 5, None):
        refused(lambda v=value: names(v, "X.names"), said="X.names: expected a name or a list")
    refused(lambda: names([], "X.names"), said="at least one name")
    assert names([], "X.names", empty=True) == ()
    refused(lambda: names(["a", 5], "X.names"), said="X.names[1]")
    upper = lambda item, what: matching(item, what, re.compile("[A-Z]+"), "capitals")  # noqa: E731
    refused(lambda: names(["A", "b"], "X.names", each=upper), said="X.names[1]: expected capitals")


def test_mapping_has_str_keys_and_may_name_the_allowed_ones() -> None:
    given = {"a": 1}
    copied = mapping(given, "X.m")
    assert copied == given and copied is not given
    for value in ("a=1", ["a"], 5, None):
        refused(lambda v=value: mapping(v, "X.m"), said="X.m: expected a mapping")
    refused(lambda: mapping({1: 2}, "X.m"), said="X.m key")
    refused(
        lambda: mapping({"x": 1}, "X.m", allowed={"a"}, allowed_are="a driver option"),
        said="X.m key: expected a driver option, got 'x' (str)",
    )


def test_matching_wants_the_whole_string() -> None:
    topic = re.compile(r"[a-z]+")
    assert matching("abc", "X.t", topic, "letters") == "abc"
    for value in ("a b", "abc ", 5):
        refused(lambda v=value: matching(v, "X.t", topic, "letters"), said="X.t: expected letters")


def test_kinds_are_exception_classes() -> None:
    assert kinds(KeyError, "X.k") == (KeyError,)
    assert kinds([KeyError, OSError], "X.k") == (KeyError, OSError)
    for value in ("KeyError", 5, {"a": 1}, (KeyError, "x"), [int]):
        refused(lambda v=value: kinds(v, "X.k"), said="X.k")


def test_functions_are_one_callable_or_a_list_of_them() -> None:
    assert functions(print, "X.fs") == (print,)
    assert functions([print, len], "X.fs") == (print, len)
    assert functions((), "X.fs") == ()
    for value in ("print", {"a": print}, 5, b"x"):
        refused(lambda v=value: functions(v, "X.fs"), said="X.fs: expected a callable or a list")
    refused(lambda: functions([print, "len"], "X.fs"), said="X.fs[1]: expected a callable")
    refused(lambda: functions(int, "X.fs"), said="X.fs")  # a class is not taken as one


def test_function_instance_choice_and_maybe() -> None:
    assert function(len, "X.f") is len
    refused(lambda: function("len", "X.f"), said="X.f: expected a callable, got 'len' (str)")
    assert instance(3, "X.i", int, "an int") == 3
    refused(
        lambda: instance({}, "X.i", int, "a thing"), said="X.i: expected a thing, got {} (dict)"
    )
    assert choice("a", "X.c", ("a", "b")) == "a"
    refused(lambda: choice(1, "X.c", (True,)), said="one of True")
    assert maybe(None, "X.m", integer) is None
    assert maybe(2, "X.m", integer, at_least=1) == 2
    refused(lambda: maybe("2", "X.m", integer), said="X.m")


def test_a_secret_is_never_quoted_and_long_values_are_cut() -> None:
    said = str(refuse("X.password", "hunter2", "a str", secret=True))
    assert "hunter2" not in said and "a str" in said
    said = str(refuse("X.v", "y" * 500, "short"))
    assert len(said) < 200 and "..." in said
