"""The built wheel holds every module, and works installed on its own in a fresh venv.

The packages were once listed by hand and consumerdedup.testing was left out:
``consumerdedup demo`` failed for everyone who installed from the wheel. The
build is from a copy of the sources, so the checkout gets no build/ folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["pyproject.toml", "setup.py", "README.md", "consumerdedup", "adapters"]
# every public module imports with these
EXTRAS = "postgres,sqlite-async,kafka,rabbitmq,redis,fastapi,app,celery,faststream,admin"

pytestmark = pytest.mark.slow


def source_modules() -> set[str]:
    """Every module of the source tree, named as installed (adapters/ is consumerdedup.adapters)."""
    found = set()
    roots = {"consumerdedup": "consumerdedup", "adapters": "consumerdedup.adapters"}
    for top, package in roots.items():
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT / top).with_suffix("").parts
            found.add(".".join((package, *parts)))
    return found


def wheel_modules(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.endswith(".py")]
    return {n.removesuffix(".py").replace("/", ".") for n in names}


def public(modules: set[str]) -> list[str]:
    """Importable without side effects: no private module, no __main__."""
    named = set()
    for module in modules:
        *parents, last = module.split(".")
        if last == "__init__":
            named.add(".".join(parents))
        elif not last.startswith("_"):
            named.add(module)
    return sorted(named)


def run(*args: str | Path, cwd: Path) -> str:
    # A clean environment: nothing of this checkout or its venv may leak in.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, f"{args}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_the_wheel_installs_alone_and_runs_the_demo(tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            skip = shutil.ignore_patterns("__pycache__")
            shutil.copytree(ROOT / name, source / name, ignore=skip)
        elif (ROOT / name).exists():
            shutil.copy2(ROOT / name, source / name)
    dist = tmp_path / "dist"
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", dist, source, cwd=tmp_path)
    [wheel] = dist.glob("consumerdedup-*.whl")
    modules = wheel_modules(wheel)
    assert modules == source_modules()

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    run(python, "-m", "pip", "install", "-q", f"{wheel}[{EXTRAS}]", cwd=tmp_path)

    out = run(venv / "bin" / "consumerdedup", "demo", cwd=tmp_path)
    assert out.strip(), "the demo printed nothing"
    names = public(modules)
    check = (
        "import importlib\n"
        f"for name in {names!r}:\n"
        "    module = importlib.import_module(name)\n"
        f"    assert module.__file__.startswith({str(venv)!r}), module.__file__\n"
    )
    run(python, "-c", check, cwd=tmp_path)
    assert "consumerdedup.testing" in names and "consumerdedup.adapters.kafka" in names
