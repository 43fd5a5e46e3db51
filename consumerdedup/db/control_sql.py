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

MySQL and MariaDB are read as their lexer reads (``#`` comments, ``-- `` only before a
space, ``/*! */`` and ``/*M! */`` comments whose text the server runs, backslash escapes in
``'...'`` and ``"..."`` or not, as ``sql_mode`` says), and there a statement that commits
implicitly counts as control too: DDL (but a TEMPORARY table's), LOCK/UNLOCK TABLES, SET
autocommit, XA, replication and administration statements, and SQL that cannot be
read: run from a string (PREPARE, EXECUTE) or by a procedure (CALL: a MySQL procedure
may COMMIT). So do changes of the session that later messages on the pooled connection
would inherit: its character set (SET NAMES), isolation, default database (USE).
On PostgreSQL and SQLite DDL is transactional.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass

_WORDS = ("COMMIT", "END", "ABORT", "ROLLBACK", "BEGIN", "START", "PREPARE", "NAMES", "ENCODING")
_ANY_WORD = re.compile(
    r"\b(?:COMMIT|END|ABORT|ROLLBACK|BEGIN|START|PREPARE|NAMES|CLIENT_ENCODING)\b", re.IGNORECASE
)
_WORD = re.compile(r"[A-Za-z_][A-Za-z_0-9$]*")
_NAME = re.compile("[A-Za-z_\u0080-\U0010ffff][A-Za-z_0-9$\u0080-\U0010ffff]*")
"""A word as a name may be written unquoted (a letter past ASCII may start it)."""
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
    mysql: bool = False  # MySQL/MariaDB's lexer (the module's doc) and implicit commits
    quote_escapes: bool = False  # MySQL: backslash escapes in "..." too (no ANSI_QUOTES)


def _mysql_reading(backslash: bool, quote_escapes: bool) -> _Reading:
    return _Reading(
        nested_comments=False,
        backslash_escapes=backslash,
        dollar_quotes=False,
        brackets=False,
        e_strings=False,
        mysql=True,
        quote_escapes=quote_escapes,
    )


_MYSQL_READINGS = (
    _mysql_reading(backslash=True, quote_escapes=True),  # the default sql_mode
    _mysql_reading(backslash=True, quote_escapes=False),  # ANSI_QUOTES
    _mysql_reading(backslash=False, quote_escapes=False),  # NO_BACKSLASH_ESCAPES
)
"""A handler may change its session's sql_mode: every way counts."""

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
    "mysql": _MYSQL_READINGS,
    "mariadb": _MYSQL_READINGS,
}
_FOLDED = ("sqlite", "mysql", "mariadb")
"""Dialects whose savepoint names ignore case."""


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
    readings = _READINGS.get(dialect) or tuple(r for rs in _READINGS.values() for r in rs)
    upper = sql.upper()
    mysql = any(reading.mysql for reading in readings)
    if "SET_CONFIG" in upper and "CLIENT_ENCODING" in upper:  # set_config('client_encoding'
        return "set_config of client_encoding (the messages after this one inherit it)"
    if not mysql and (not any(word in upper for word in _WORDS) or not _ANY_WORD.search(sql)):
        return None  # the common case: no such word anywhere in the text
    if mysql and not _MYSQL_ANY_WORD.search(sql):
        return None  # the common case on MySQL
    for reading in readings:
        for words in _statement_heads(sql, reading, every=reading.mysql):
            found = _mysql_control(words) if reading.mysql else _control(words)
            if found:
                return found
    return None


_MYSQL_ANY_WORD = re.compile(
    r"(?:\b(?:COMMIT|END|ABORT|ROLLBACK|BEGIN|START|STOP|PREPARE|EXECUTE|CREATE|DROP|ALTER|"
    r"RENAME|TRUNCATE|LOCK|UNLOCK|SET|XA|GRANT|REVOKE|ANALYZE|OPTIMIZE|REPAIR|CHECK|CACHE|"
    r"LOAD|FLUSH|RESET|INSTALL|UNINSTALL|CHANGE|SHUTDOWN|BACKUP|CALL|USE)\b|/\*M?!)",
    re.IGNORECASE,
)
_SESSION_STATE = frozenset(
    {
        "CHARACTER_SET_CLIENT",
        "CHARACTER_SET_CONNECTION",
        "CHARACTER_SET_RESULTS",
        "COLLATION_CONNECTION",
        "TRANSACTION",  # SET [SESSION] TRANSACTION ISOLATION LEVEL ...
        "TX_ISOLATION",
        "TRANSACTION_ISOLATION",
    }
)
"""Session variables a handler's SET would change for later messages on the pooled
connection: how the keys of our records are read (``SET NAMES latin1`` stored 'é' as
'Ã©', so its redelivery on another connection was no DUPLICATE), or the isolation checked
once per connection."""
_IMPLICIT_COMMITS = frozenset(
    {
        "ALTER",
        "RENAME",
        "TRUNCATE",
        "LOCK",
        "UNLOCK",
        "XA",
        "GRANT",
        "REVOKE",
        "OPTIMIZE",
        "REPAIR",
        "CHECK",
        "CACHE",
        "FLUSH",
        "RESET",
        "INSTALL",
        "UNINSTALL",
        "CHANGE",
        "SHUTDOWN",
        "BACKUP",
        "START",  # START TRANSACTION, START SLAVE / REPLICA / ALL SLAVES
        "STOP",
        "PREPARE",  # PREPARE TRANSACTION, or SQL from a string that cannot be read
        "EXECUTE",  # EXECUTE a prepared statement, EXECUTE IMMEDIATE
    }
)
"""MySQL/MariaDB statements that commit the transaction (the manual's "Statements That Cause
an Implicit Commit") or run SQL that cannot be read before it is sent."""


def _mysql_control(words: list[str]) -> str | None:
    """``_control`` on MySQL/MariaDB, from every word of a statement (upper case)."""
    found = _control(words[:3])
    if found or not words:
        return found
    first = words[0]
    if first == "SET":
        if "AUTOCOMMIT" in words or words[1:2] == ["PASSWORD"]:
            return " ".join(words[:2]) if words[1:2] == ["PASSWORD"] else "SET autocommit"
        if words[1:2] in (["NAMES"], ["CHARSET"], ["CHARACTER"]) or _SESSION_STATE & set(words):
            return (
                f"{' '.join(words[:3])} (changes the session's character set or isolation "
                "for the messages after this one on the pooled connection too)"
            )
        if words[1:2] == ["STATEMENT"] and "FOR" in words:  # MariaDB: SET STATEMENT .. FOR stmt
            return _mysql_control(words[words.index("FOR") + 1 :])
        return None
    if first == "USE":  # the default database of our records, for the messages after this
        return "USE (changes the session's database, where unqualified tables are)"
    if first in ("CREATE", "DROP"):
        # CREATE [OR REPLACE] TEMPORARY TABLE, DROP TEMPORARY TABLE: no implicit commit.
        return None if "TEMPORARY" in words[1:4] else f"{first} (commits implicitly)"
    if first == "ANALYZE":  # ANALYZE TABLE commits; MariaDB's ANALYZE SELECT runs a query
        table = words[1:2] in (["TABLE"], ["TABLES"], ["NO_WRITE_TO_BINLOG"], ["LOCAL"])
        return "ANALYZE TABLE (commits implicitly)" if table else None
    if first == "LOAD":  # LOAD INDEX INTO CACHE commits; LOAD DATA and LOAD XML do not
        return "LOAD INDEX (commits implicitly)" if words[1:2] == ["INDEX"] else None
    if first in ("PREPARE", "EXECUTE"):
        return f"{' '.join(words[:2])} (runs SQL from a string, which cannot be read)"
    if first == "CALL":  # a MySQL procedure may COMMIT (PostgreSQL's may not, in a block)
        return "CALL (a procedure may commit, and what it runs cannot be read)"
    if first in _IMPLICIT_COMMITS:
        return f"{' '.join(words[:2])} (commits implicitly)"
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


def may_set_path(sql: str) -> bool:
    """Whether PostgreSQL ``sql`` may change the search_path: a SET or RESET statement (of
    any setting: SET SCHEMA, SET ROLE and RESET ALL change it too), or a call of set_config.
    Not seen: a function that sets it inside (a false alarm costs a round trip; a miss,
    this reader's caller's own to state)."""
    if len(sql) <= _CACHED_TEXT:
        return _path_judged(sql)
    return _may_set_path(sql)


@functools.lru_cache(maxsize=2048)
def _path_judged(sql: str) -> bool:
    return _may_set_path(sql)


def _may_set_path(sql: str) -> bool:
    upper = sql.upper()
    if "SET" not in upper:
        return False  # the common case
    if "SET_CONFIG" in upper:
        return True
    return any(
        words[:1] in (["SET"], ["RESET"])
        for reading in _READINGS["postgresql"]
        for words in _statement_heads(sql, reading)
    )


Step = tuple[str, str | None]
"""A savepoint statement: ``SAVEPOINT``, ``RELEASE`` or ``ROLLBACK TO``, and the name it
names as the server compares names (None: a name this reading cannot tell)."""
_UNREADABLE: tuple[Step, ...] = (("ROLLBACK TO", None),)


def savepoint_steps(sql: str, dialect: str) -> tuple[Step, ...]:
    """The savepoint statements of ``sql``, in order, with their names (read as
    ``transaction_control`` reads). Readings that disagree give one ``ROLLBACK TO`` of an
    unreadable name: a caller that refuses what it cannot follow refuses it."""
    if len(sql) <= _CACHED_TEXT:
        return _steps_judged(sql, dialect)
    return _steps(sql, dialect)


@functools.lru_cache(maxsize=2048)
def _steps_judged(sql: str, dialect: str) -> tuple[Step, ...]:
    return _steps(sql, dialect)


def _steps(sql: str, dialect: str) -> tuple[Step, ...]:
    upper = sql.upper()
    if "SAVEPOINT" not in upper and "RELEASE" not in upper and "ROLLBACK" not in upper:
        return ()  # the common case
    readings = _READINGS.get(dialect) or tuple(r for rs in _READINGS.values() for r in rs)
    fold = dialect in _FOLDED or dialect not in _READINGS  # SQLite, MySQL: names ignore case
    found = {
        tuple(
            step
            for words in _statement_heads(sql, reading, raw=True)
            if (step := _step(words, fold)) is not None
        )
        for reading in readings
    }
    return found.pop() if len(found) == 1 else _UNREADABLE


def _step(words: list[str], fold: bool) -> Step | None:
    """A savepoint statement's verb and name, from its first words as written."""
    keys = [w.upper() for w in words]
    if keys[:1] == ["SAVEPOINT"]:
        return "SAVEPOINT", _name(words[1:2], fold)
    if keys[:1] == ["RELEASE"]:
        rest = 2 if keys[1:2] == ["SAVEPOINT"] else 1
        return "RELEASE", _name(words[rest : rest + 1], fold)
    if keys[:1] != ["ROLLBACK"]:
        return None
    at = 2 if keys[1:2] in (["WORK"], ["TRANSACTION"]) else 1
    if keys[at : at + 1] != ["TO"]:
        return None
    at += 2 if keys[at + 1 : at + 2] == ["SAVEPOINT"] else 1
    return "ROLLBACK TO", _name(words[at : at + 1], fold)


def _name(word: list[str], fold: bool) -> str | None:
    """A name as the server compares it: a quoted one as written (its doubled quotes
    single), an unquoted one folded to lower case (ASCII only, as PostgreSQL folds)."""
    if not word:
        return None
    name = word[0]
    if name[0] in '"`[':
        close = "]" if name[0] == "[" else name[0]
        if len(name) < 2 or name[-1] != close:
            return None
        name = name[1:-1].replace(close * 2, close)
        return name.lower() if fold else name
    if fold:
        return name.lower()
    return name.translate(_ASCII_LOWER)


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


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
    if first == "SET" and (words[1:2] == ["NAMES"] or "CLIENT_ENCODING" in words[1:3]):
        # PostgreSQL: the session's encoding outlives the transaction; the next message on
        # the pooled connection would be sent in it (an id it cannot encode: FAILED there).
        return "SET NAMES / client_encoding (later messages on the connection inherit it)"
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


def _statement_heads(
    sql: str, reading: _Reading, raw: bool = False, every: bool = False
) -> Iterator[list[str]]:
    """The first three words (upper case) of each statement of ``sql``. ``raw``: the first
    six as written, a quoted name among them as one word with its quotes. ``every``: every
    word of the statement, wherever it stands (upper case)."""
    words: list[str] = []
    most = 6 if raw else 3
    head = True  # still reading the statement's leading words
    plain_run = _MYSQL_PLAIN if reading.mysql else _PLAIN
    running = False  # inside a MySQL comment whose text the server runs (/*! ... */)
    i, n = 0, len(sql)
    while i < n:
        if not head and (plain := plain_run.match(sql, i)):  # past the head: jump on
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
        elif running and sql.startswith("*/", i):
            running, i = False, i + 2
        elif reading.mysql and (c == "#" or _mysql_dashes(sql, i)):
            newline = sql.find("\n", i)  # MySQL's line comment ends at LF only
            i = n if newline < 0 else newline + 1
        elif not reading.mysql and sql.startswith("--", i):
            end = _LINE_END.search(sql, i)
            i = n if end is None else end.end()
        elif reading.mysql and (run := _RUN_COMMENT.match(sql, i)):
            running, i = True, run.end()  # the server runs its text (any version: read it)
        elif sql.startswith("/*", i):
            i = _skip_block_comment(sql, i, reading.nested_comments)
        elif (
            head
            and (match := (_NAME if raw else _WORD).match(sql, i))
            and not _quote_prefix(sql, match)
        ):
            words.append(match.group() if raw else match.group().upper())
            head = every or len(words) < most
            i = match.end()
        elif raw and head and _quoted_name(sql[i], reading):
            after = _skip_token(sql, i, reading)
            words.append(sql[i:after])
            head = len(words) < most
            i = after
        else:
            i = _skip_token(sql, i, reading)
            head = every
    yield words


_MYSQL_PLAIN = re.compile(r"[^;'\"\-/$`\[#*]+")
_RUN_COMMENT = re.compile(r"/\*M?![0-9]*")
"""MySQL's ``/*!`` (and MariaDB's ``/*M!``) with its optional version: the text up to
``*/`` is run by a server at least that version."""


def _mysql_dashes(sql: str, i: int) -> bool:
    """MySQL's ``--`` comment: the two dashes then a space or control character (or the
    end); ``--x`` is two minus signs."""
    if not sql.startswith("--", i):
        return False
    return i + 2 >= len(sql) or sql[i + 2].isspace() or ord(sql[i + 2]) < 32


def _quoted_name(c: str, reading: _Reading) -> bool:
    return c == '"' or (reading.brackets and c in "`[") or (reading.mysql and c == "`")


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
        return _skip_quoted(sql, i, '"', reading.quote_escapes)
    if (reading.brackets or reading.mysql) and c == "`":
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
