"""What the docs say exists does (issue 38, item 14): README.md and docs/*.md are read for
the claims they make about the code, and each is checked against it.

- Every ``consumerdedup COMMAND ... --flag`` they show (in code spans and blocks, and the
  synopsis block of docs/cli.md) is a command of the real parser, and every flag one of
  that command's options (the argparse tree is walked, not a list kept by hand).
- Every dotted name ``consumerdedup.x.y`` in a code span imports (a module, or a name in
  one).
- Every option shown for a class, as ``Class(option=...)``, ``Class.option`` or in a
  ``- **Class**: `option=default`, ...`` bullet, is a parameter of that class's
  constructor (or an attribute of it).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import re
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest

import consumerdedup
from consumerdedup.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
SPAN = re.compile(r"`([^`\n]+(?:\n[^`\n]+)*)`")
COMMAND_LINE = re.compile(r"(?:^|[\s`$(])consumerdedup((?: +[^\s`|;&)]+)*)", re.MULTILINE)
SHELL = {"", "bash", "sh", "shell", "console", "text"}


# --- the pages -------------------------------------------------------------------------------


def prose(text: str) -> str:
    """The page without its fenced blocks."""
    return FENCE.sub("", text)


def spans(text: str) -> Iterator[str]:
    """The inline code spans of the page's prose (one may run over a line break)."""
    for found in SPAN.finditer(prose(text)):
        yield " ".join(found.group(1).split())


def pages() -> Iterator[tuple[str, str]]:
    for page in PAGES:
        yield page.relative_to(ROOT).as_posix(), page.read_text()


# --- the command line ------------------------------------------------------------------------


Tree = dict[tuple[str, ...], argparse.ArgumentParser]


def parsers() -> Tree:
    """Every parser of the command line by its path: () the top, ("failed", "replay")..."""
    found: Tree = {}

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        found[path] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, (*path, name))

    walk(build_parser(), ())
    return found


TREE = parsers()


def options(path: tuple[str, ...]) -> dict[str, argparse.Action]:
    return {o: a for a in TREE[path]._actions for o in a.option_strings}


def command_of(tokens: list[str]) -> tuple[tuple[str, ...], list[str]]:
    """The command path the tokens name (global options and their values skipped), and
    the tokens after it."""
    path: tuple[str, ...] = ()
    rest = list(tokens)
    while rest:
        token = rest[0]
        if token.startswith("--") and path == ():
            action = options(()).get(token.split("=")[0])
            rest = rest[1:] if action is None or action.nargs == 0 or "=" in token else rest[2:]
            continue
        if (*path, token) in TREE:
            path, rest = (*path, token), rest[1:]
            continue
        break
    return path, rest


def flags(tokens: list[str]) -> list[str]:
    """The ``--flag`` names in the tokens (``--kafka/--rabbitmq``: both; ``--all)``: --all)."""
    return [f for t in tokens for f in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", t)]


def command_claims() -> Iterator[tuple[str, tuple[str, ...], list[str], str]]:
    """(page, command path, flags, the line) of each command line the pages show."""
    for name, text in pages():
        texts = [*spans(text)]
        texts += [code for lang, code in FENCE.findall(text) if lang in SHELL]
        for piece in texts:
            for found in COMMAND_LINE.finditer(piece):
                tokens = found.group(1).split()
                if not tokens or tokens[0].startswith("#"):
                    continue
                tokens = tokens[: next((i for i, t in enumerate(tokens) if t == "#"), None)]
                path, rest = command_of(tokens)
                if path == () and rest and re.fullmatch(r"[a-z][a-z-]*", rest[0]):
                    path = ("?" + rest[0],)  # a word where a command belongs
                yield name, path, flags(rest), found.group(0).strip()


def synopsis_claims() -> Iterator[tuple[tuple[str, ...], list[str], str]]:
    """docs/cli.md's synopsis: a line at two spaces names a command (and its action), the
    lines under it, up to the next, are its flags and their help."""
    text = (ROOT / "docs" / "cli.md").read_text()
    block = next(code for lang, code in FENCE.findall(text) if code.startswith("consumerdedup ["))
    first, *lines = block.splitlines()
    yield (), flags(first.split()), first
    path: tuple[str, ...] = ()
    for line in lines:
        if re.match(r"^  \S", line):
            words = line.split()
            path = (words[0],)
            if len(words) > 1 and (words[0], words[1]) in TREE:
                path = (words[0], words[1])
            assert path in TREE, f"docs/cli.md's synopsis names a command that is not: {line}"
        yield path, flags(line.split()), line


def test_the_pages_show_commands() -> None:
    """The checks below run on something."""
    shown = {path for _, path, _, _ in command_claims()}
    assert {("prune",), ("failed", "replay"), ("doctor",)} <= shown, shown


@pytest.mark.parametrize("page", [p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_command_and_flag_a_page_shows_exists(page: str) -> None:
    wrong = []
    for name, path, given, line in command_claims():
        if name != page:
            continue
        if path not in TREE:
            wrong.append(f"no command {path[0][1:]!r}: {line}")
            continue
        known = options(path)
        wrong += [f"{' '.join(path)} has no {flag}: {line}" for flag in given if flag not in known]
    assert not wrong, "\n".join(wrong)


def test_every_flag_of_the_cli_synopsis_exists() -> None:
    wrong = []
    for path, given, line in synopsis_claims():
        known = options(path)
        wrong += [
            f"{' '.join(path)} has no {flag}: {line.strip()}" for flag in given if flag not in known
        ]
    assert not wrong, "\n".join(wrong)


def test_every_command_is_documented() -> None:
    """The other way round: each command the parser has is shown somewhere."""
    documented = {path for path, _, _ in synopsis_claims()}
    documented |= {path for _, path, _, _ in command_claims()}
    leaves = {p for p, parser in TREE.items() if p and not parser._subparsers}
    assert leaves <= documented, sorted(leaves - documented)


# --- Python names ----------------------------------------------------------------------------


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` is a module, or a name reached from the longest module prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as error:
            if not (error.name or "").startswith("consumerdedup"):
                raise  # an extra not installed: a setup fault, not the docs'
            continue
        for attribute in parts[cut:]:
            if not hasattr(found, attribute):
                return False
            found = getattr(found, attribute)
        return True
    return False


def named_in_the_code(name: str) -> bool:
    """Whether the package's or the adapters' source has ``name`` as a string: a telemetry
    attribute, an instrument (``consumerdedup.outbox.backlog``) or a logger
    (``consumerdedup.kafka``) is a name the code emits, not imports."""
    quoted = (f'"{name}"', f"'{name}'")
    sources = [*(ROOT / "consumerdedup").rglob("*.py"), *(ROOT / "adapters").rglob("*.py")]
    return any(q in path.read_text() for path in sources for q in quoted)


def dotted_claims() -> Iterator[tuple[str, str]]:
    for name, text in pages():
        for span in spans(text):
            for found in re.finditer(r"(?<![\w./-])consumerdedup(?:\.[A-Za-z_]\w*)+", span):
                yield name, found.group(0)


def test_every_dotted_name_imports() -> None:
    claims = list(dotted_claims())
    assert len(claims) > 20
    wrong = sorted(
        {
            f"{page}: {dotted}"
            for page, dotted in claims
            if not resolves(dotted) and not named_in_the_code(dotted)
        }
    )
    assert not wrong, "\n".join(wrong)


# --- options of classes ----------------------------------------------------------------------


def public_classes() -> dict[str, list[type]]:
    """Every class the package's modules define, by name (a name two modules use has both);
    a module whose extra is not installed is left out."""
    found: dict[str, list[type]] = {}
    prefix = consumerdedup.__name__ + "."
    walked = pkgutil.walk_packages(consumerdedup.__path__, prefix, onerror=lambda _name: None)
    names = [m.name for m in walked]
    for module_name in [
        consumerdedup.__name__,
        *names,
        "consumerdedup.adapters.kafka",
        "consumerdedup.adapters.rabbitmq",
    ]:
        try:
            module = importlib.import_module(module_name)
        except Exception:  # an extra not installed; a broken module fails other tests
            continue
        for name, value in vars(module).items():
            ours = inspect.isclass(value) and value.__module__.startswith("consumerdedup")
            if ours and value not in found.setdefault(name, []):
                found[name].append(value)
    return found


CLASSES = public_classes()


def has_option(cls: type, option: str) -> bool:
    """``option`` is a parameter of the constructor (a key of the TypedDict its
    ``**settings: Unpack[...]`` takes, too) or an attribute of the class."""
    try:
        parameters = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return hasattr(cls, option)
    if option in parameters or hasattr(cls, option):
        return True
    for parameter in parameters.values():
        # The annotation as written (``Unpack[PrunerSettings]``; Unpack may be imported for
        # type checking only), its TypedDict found among the package's classes.
        unpacked = re.fullmatch(r"Unpack\[(\w+)\]", str(parameter.annotation))
        if parameter.kind is parameter.VAR_KEYWORD and unpacked:
            settings = CLASSES.get(unpacked.group(1), [])
            if any(option in typing.get_type_hints(kind) for kind in settings):
                return True
    return False


def arguments(text: str, start: int) -> str:
    """The text of a call's arguments: from ``start`` (after its "(") to its ")"."""
    depth = 1
    for i in range(start, len(text)):
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return text[start:]


def keywords(arguments: str) -> list[str]:
    """The ``name=`` keywords at the top level of a call's argument text."""
    depth, found, word = 0, [], ""
    for i, c in enumerate(arguments):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        named = re.fullmatch(r"[A-Za-z_]\w*", word.strip())
        if depth == 0 and c == "=" and arguments[i + 1 : i + 2] != "=" and named:
            found.append(word.strip())
        word = "" if c in ",(=" and depth <= 1 else word + c
    return found


def option_claims() -> Iterator[tuple[str, str, str, str]]:
    """(page, class, option, where) of each option the pages give a class: in a call or
    after a dot, any class; in a bullet, a configuration class (``...Config``)."""
    for page, text in pages():
        for span in spans(text):
            for call in re.finditer(r"\b([A-Z]\w+)\(", span):
                for option in keywords(arguments(span, call.end())):
                    yield page, call.group(1), option, span
            for attribute in re.finditer(r"\b([A-Z]\w+)\.([a-z_]\w*)", span):
                yield page, attribute.group(1), attribute.group(2), span
        for bullet in re.finditer(
            r"^- \*\*([A-Z]\w*Config)\*\*:(.*?)(?=^\S|^- |\Z)",
            prose(text),
            re.MULTILINE | re.DOTALL,
        ):
            for option in bullet_options(bullet.group(2)):
                yield page, bullet.group(1), option, bullet.group(0)[:60]


def bullet_options(text: str) -> Iterator[str]:
    """The ``option`` and ``option=default`` spans of a bullet, outside its parentheses
    (where it names other things: a driver's options, an old spelling)."""
    depth = 0
    for piece in re.split(r"(`[^`]*`)", text):
        if piece.startswith("`"):
            found = re.fullmatch(r"`([a-z_][a-z0-9_]*)(=[^`]*)?`", piece)
            if found and depth == 0:
                yield found.group(1)
            continue
        depth += piece.count("(") - piece.count(")")


def test_every_option_of_a_class_exists() -> None:
    claims = [c for c in option_claims() if c[1] in CLASSES]
    assert {"RelayConfig", "RabbitConfig", "KafkaConfig"} <= {c[1] for c in claims}
    wrong = sorted(
        {
            f"{page}: {cls}.{option} ({where})"
            for page, cls, option, where in claims
            if not any(has_option(k, option) for k in CLASSES[cls])
        }
    )
    assert not wrong, "\n".join(wrong)


# --- known limits ----------------------------------------------------------------------------

MISSING = re.compile(r"\bnot (?:yet )?(?:built|implemented|written|available)\b", re.IGNORECASE)


def features() -> dict[str, str]:
    """The features the core's classes offer, as prose names them (``bulk_handler``: "bulk
    handler"), each with where it is."""
    found = {}
    for cls in (
        consumerdedup.Deduplicator,
        consumerdedup.AsyncDeduplicator,
        consumerdedup.OutboxRelay,
        consumerdedup.Outbox,
        consumerdedup.Pruner,
    ):
        for name in dir(cls):
            if not name.startswith("_") and "_" in name:  # one word ("run") says too little
                found[name.replace("_", " ")] = f"{cls.__name__}.{name}"
    return found


def test_no_known_limit_says_a_feature_the_code_has_is_missing() -> None:
    """docs/index.md's "Known limits": a limit that says something is not built names no
    feature the code has (it said so of bulk handlers long after they were built)."""
    text = (ROOT / "docs" / "index.md").read_text()
    limits = text.split("## Known limits", 1)[1].split("\n## ", 1)[0]
    bullets = [" ".join(b.split()) for b in re.split(r"^- ", limits, flags=re.MULTILINE)[1:]]
    assert bullets, "no Known limits section"
    wrong = [
        f"{where} exists, yet: {bullet}"
        for bullet in bullets
        if MISSING.search(bullet)
        for phrase, where in features().items()
        if phrase in bullet.lower()
    ]
    assert not wrong, "\n".join(wrong)
