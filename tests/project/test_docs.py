"""The docs' code is real: every Python block in README.md and docs/*.md is either taken
from a file under examples/ (which tests/project/test_examples.py runs) or compiles, and
the names it imports exist; the README's quick start runs as pasted; the walkthrough's
example prints what docs/walkthrough.md says; every relative link points at a file.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def blocks(page: Path, language: str = "python") -> list[str]:
    return [code for lang, code in FENCE.findall(page.read_text()) if lang == language]


def python_blocks() -> list[tuple[str, int, str]]:
    return [
        (page.relative_to(ROOT).as_posix(), n, code)
        for page in PAGES
        for n, code in enumerate(blocks(page), 1)
    ]


def from_an_example(code: str) -> Path | None:
    """The example file that holds this block, line for line and in one piece."""
    wanted = code.rstrip() + "\n"
    for example in sorted(EXAMPLES.glob("*.py")):
        if wanted in example.read_text():
            return example
    return None


def ours(node: ast.stmt) -> bool:
    """An import of consumerdedup or one of its modules."""
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").split(".")[0] == "consumerdedup"
    if isinstance(node, ast.Import):
        return all(alias.name.split(".")[0] == "consumerdedup" for alias in node.names)
    return False


def quick_start() -> str:
    """The library's quick start (the section leads with the App, from an example too)."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### The library underneath", 1)[1].split("\n## ", 1)[0]
    found = FENCE.search(section)
    assert found and found.group(1) == "python", "the quick start has no python block"
    return found.group(2)


def test_the_pages_have_python_blocks() -> None:
    """The checks below run on something: a page's fences use ```python."""
    assert len(python_blocks()) >= 15
    assert {path for path, _, _ in python_blocks()} >= {"README.md", "docs/walkthrough.md"}


@pytest.mark.parametrize(
    ("page", "n", "code"),
    python_blocks(),
    ids=[f"{page}#{n}" for page, n, _ in python_blocks()],
)
def test_each_python_block_is_taken_from_an_example_or_compiles(
    page: str, n: int, code: str
) -> None:
    if from_an_example(code) is not None:
        return
    # Not an example's: a sketch (`...` for what the reader writes), which must still be
    # Python, and whose imports of consumerdedup must name things that exist (the
    # reader's own modules, `myapp`, need not).
    tree = compile(
        code, f"{page}#{n}", "exec", flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    )
    imports = [node for node in tree.body if ours(node)]
    exec(compile(ast.Module(imports, type_ignores=[]), f"{page}#{n}", "exec"), {})


def test_the_quick_start_is_the_example_whole() -> None:
    assert from_an_example(quick_start()) == EXAMPLES / "quickstart.py"
    assert "..." not in quick_start(), "the quick start must run as pasted"


def test_the_quick_start_runs_as_pasted(tmp_path: Path) -> None:
    script = tmp_path / "pasted.py"
    script.write_text(quick_start())
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "alice's balance: 25" in done.stdout


def test_the_walkthrough_prints_what_its_page_says(tmp_path: Path) -> None:
    """Its blocks are the example's (checked above); run in an empty folder, the example
    prints the output the page shows."""
    page = ROOT / "docs" / "walkthrough.md"
    for code in blocks(page):
        assert from_an_example(code) == EXAMPLES / "walkthrough.py", code
    shown = next(code for code in blocks(page, "") if code.startswith("deliveries:"))
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "walkthrough.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == shown


LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_relative_links_point_at_files(page: Path) -> None:
    missing = [
        target
        for target, _ in LINK.findall(page.read_text())
        if "://" not in target and not (page.parent / target).exists()
    ]
    assert not missing, f"{page.name} links to missing files: {missing}"
