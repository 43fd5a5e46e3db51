"""Does a SQL text hold a statement that ends or begins a transaction, in any spelling?

The text is split the way the server's own lexer splits it: comments (``--``
to the end of the line, ``/* */``, nested on PostgreSQL, not on SQLite),
string literals, quoted identifiers and dollar quotes are skipped, and every
statement between semicolons is judged by its first words. A spelling the
lexers below might read differently from the server (PostgreSQL with
``standard_conforming_strings`` off makes backslash an escape in ``'...'``) is
read every way it could be, and refused if any reading finds such a
statement: a false alarm costs a clear error, a miss costs a lost effect.

This check runs before a statement is sent; the driver's transaction state
after it (handler_guard) catches whatever reaches the server anyway.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass

_WORDS = ("COMMIT", "END", "ABORT", "ROLLBACK", "BEGIN", "START", "PREPARE")
_ANY_WORD = re.compile(r"\b(?:COMMIT|END|ABORT|ROLLBACK|BEGIN|START|PREPARE)\b", re.IGNORECASE)
_WORD = re.compile(r"[A-Za-z_][A-Za-z_0-9$]*")
_PLAIN = re.compile(r"[^;'\"\-/$`\[]+")
"""A run of characters that cannot start a statement break, a comment or a quote."""
# Every character past ASCII is a name character to both servers (PostgreSQL: any byte of
# \200-\377 in UTF-8), those outside the BMP (emoji) included.
_NAME_CHAR = re.compile("[A-Za-z_0-9$\u0080-\U0010ffff]")
_DOLLAR_TAG = re.compile("\\$(?:[A-Za-z_\u0080-\U0010ffff][A-Za-z_0-9\u0080-\U0010ffff]*)?\\$")
_LINE_END = re.compile("[\r\n]")
"""A ``--`` comment ends at CR too on PostgreSQL (SQLite: LF only; reading CR as an end
there too only ever finds more statements, never fewer)."""
_LITERAL_PREFIXES = {"'": ("E", "B", "X", "N"), "&": ("U",)}
"""One-letter words that start a literal when glued to the quote (E'..', U&'..')."""


@dataclass(frozen=True)
class _Reading:
    nested_comments: bool
    backslash_escapes: bool  # in plain '...' (E'...' always has them on PostgreSQL)
    dollar_quotes: bool
    brackets: bool  # SQLite's [name] and `name`
    e_strings: bool  # PostgreSQL's E'...', where backslash escapes


_READINGS = {
    "postgresql": (
        _Reading(
            nested_comments=True,
            backslash_escapes=False,
            dollar_quotes=True,
            brackets=False,
            e_strings=True,
        ),
        _Reading(
            nested_comments=True,
            backslash_escapes=True,
            dollar_quotes=True,
            brackets=False,
            e_strings=True,
        ),
    ),
    "sqlite": (
        _Reading(
            nested_comments=False,
            backslash_escapes=False,
            dollar_quotes=False,
            brackets=True,
            e_strings=False,
        ),
    ),
}


_CACHED_TEXT = 4096
"""Texts up to this length are judged once (a handler sends the same few again and again);
longer ones, often made anew each time, would only fill the cache."""


def transaction_control(sql: str, dialect: str) -> str | None:
    """The first transaction-control statement in ``sql`` (its leading words), or None.

    Savepoints (SAVEPOINT, RELEASE, ROLLBACK TO) are not control: they nest
    inside the transaction. An unknown dialect is read every known way.
    """
    if len(sql) <= _CACHED_TEXT:
        return _judged(sql, dialect)
    return _judge(sql, dialect)


@functools.lru_cache(maxsize=2048)
def _judged(sql: str, dialect: str) -> str | None:
    return _judge(sql, dialect)


def _judge(sql: str, dialect: str) -> str | None:
    upper = sql.upper()
    if not any(word in upper for word in _WORDS) or not _ANY_WORD.search(sql):
        return None  # the common case: no such word anywhere in the text
    readings = _READINGS.get(dialect) or tuple(r for rs in _READINGS.values() for r in rs)
    for reading in readings:
        for words in _statement_heads(sql, reading):
            found = _control(words)
            if found:
                return found
    return None


def savepoint_command(sql: str, dialect: str) -> bool:
    """Whether ``sql`` holds a SAVEPOINT, RELEASE or ROLLBACK TO statement (read as
    ``transaction_control`` reads, every known way for an unknown dialect)."""
    upper = sql.upper()
    if "SAVEPOINT" not in upper and "RELEASE" not in upper and "ROLLBACK" not in upper:
        return False  # the common case
    readings = _READINGS.get(dialect) or tuple(r for rs in _READINGS.values() for r in rs)
    return any(
        _is_savepoint(words) for reading in readings for words in _statement_heads(sql, reading)
    )


def _is_savepoint(words: list[str]) -> bool:
    if words[:1] in (["SAVEPOINT"], ["RELEASE"]):
        return True
    rest = words[1:]
    if rest[:1] in (["WORK"], ["TRANSACTION"]):
        rest = rest[1:]
    return words[:1] == ["ROLLBACK"] and rest[:1] == ["TO"]


def _control(words: list[str]) -> str | None:
    if not words:
        return None
    first = words[0]
    if first in ("COMMIT", "END", "ABORT", "BEGIN"):
        return " ".join(words[:2]) if words[1:2] == ["PREPARED"] else first
    if first == "ROLLBACK":
        rest = words[1:]
        if rest[:1] in (["WORK"], ["TRANSACTION"]):
            rest = rest[1:]
        return None if rest[:1] == ["TO"] else "ROLLBACK"
    if first in ("START", "PREPARE") and words[1:2] == ["TRANSACTION"]:
        return f"{first} TRANSACTION"
    return None


def _statement_heads(sql: str, reading: _Reading) -> Iterator[list[str]]:
    """The first three words (upper case) of each statement of ``sql``."""
    words: list[str] = []
    head = True  # still reading the statement's leading words
    i, n = 0, len(sql)
    while i < n:
        if not head and (plain := _PLAIN.match(sql, i)):  # past the head: jump to what matters
            i = plain.end()
            if i >= n:
                break
        c = sql[i]
        if c == ";":
            yield words
            words, head = [], True
            i += 1
        elif c.isspace():
            i += 1
        elif sql.startswith("--", i):
            end = _LINE_END.search(sql, i)
            i = n if end is None else end.end()
        elif sql.startswith("/*", i):
            i = _skip_block_comment(sql, i, reading.nested_comments)
        elif head and (match := _WORD.match(sql, i)) and not _quote_prefix(sql, match):
            words.append(match.group().upper())
            head = len(words) < 3
            i = match.end()
        else:
            i = _skip_token(sql, i, reading)
            head = False
    yield words


def _quote_prefix(sql: str, word: re.Match[str]) -> bool:
    """A literal's prefix (E'..', U&'..', B'..'), not a keyword. Only these one-letter
    words are: any longer word glued to a quote is read by both servers as that word
    and then a string (``PREPARE TRANSACTION'x'``)."""
    end = word.end()
    return end < len(sql) and word.group().upper() in _LITERAL_PREFIXES.get(sql[end], ())


def _skip_block_comment(sql: str, i: int, nested: bool) -> int:
    depth, i = 1, i + 2
    while i < len(sql) and depth:
        if sql.startswith("*/", i):
            depth, i = depth - 1, i + 2
        elif nested and sql.startswith("/*", i):
            depth, i = depth + 1, i + 2
        else:
            i += 1
    return i


def _skip_token(sql: str, i: int, reading: _Reading) -> int:
    """Past one literal, quoted name, word or other character starting at ``i``."""
    c = sql[i]
    if c == "'":
        escaped = reading.backslash_escapes or (reading.e_strings and _e_prefix(sql, i))
        return _skip_quoted(sql, i, "'", escaped)
    if c == '"':
        return _skip_quoted(sql, i, '"', False)
    if reading.brackets and c == "`":
        return _skip_quoted(sql, i, "`", False)
    if reading.brackets and c == "[":
        end = sql.find("]", i + 1)
        return len(sql) if end < 0 else end + 1
    # PostgreSQL: a $ inside a name is part of it (a$b$ is one name), not a dollar quote.
    in_name = i > 0 and _NAME_CHAR.match(sql[i - 1]) is not None
    if reading.dollar_quotes and c == "$" and not in_name and (tag := _DOLLAR_TAG.match(sql, i)):
        end = sql.find(tag.group(), tag.end())
        return len(sql) if end < 0 else end + len(tag.group())
    if match := _WORD.match(sql, i):
        return match.end()
    return i + 1


def _e_prefix(sql: str, i: int) -> bool:
    """``E'`` as a word of its own (not the end of a name such as ``type'``)."""
    return i > 0 and sql[i - 1] in "eE" and (i < 2 or not _NAME_CHAR.match(sql[i - 2]))


def _skip_quoted(sql: str, i: int, quote: str, backslash: bool) -> int:
    i += 1
    while i < len(sql):
        c = sql[i]
        if backslash and c == "\\":
            i += 2
        elif c == quote:
            if sql.startswith(quote, i + 1):  # a doubled quote stands for itself
                i += 2
            else:
                return i + 1
        else:
            i += 1
    return i
