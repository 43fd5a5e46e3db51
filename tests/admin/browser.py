"""Headless Chromium (Debian's, at /usr/bin/chromium) driven by Playwright: one browser per
test module. Screenshots go to pytest's temporary directory, so a run leaves the
developer's tree as it was; ``CONSUMERDEDUP_SCREENSHOTS=docs/admin`` (a directory, relative
to the repository) sends them there instead, to refresh the pictures in docs/admin.md."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
REPOSITORY = Path(__file__).resolve().parents[2]
SCREENSHOTS = "CONSUMERDEDUP_SCREENSHOTS"
"""The environment variable naming where screenshots go (e.g. ``docs/admin``)."""


@contextmanager
def chromium() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()


def screenshot_dir(factory: pytest.TempPathFactory) -> Path:
    """Where this run's screenshots go: ``$CONSUMERDEDUP_SCREENSHOTS`` (relative to the
    repository) if set, else a fresh temporary directory of pytest's."""
    asked = os.environ.get(SCREENSHOTS, "").strip()
    if not asked:
        return factory.mktemp("screenshots")
    found = REPOSITORY / asked
    found.mkdir(parents=True, exist_ok=True)
    return found


def shot(page: Page, into: Path, name: str) -> Path:
    """The page as the operator sees it, saved as ``into/name.png``."""
    path = into / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
