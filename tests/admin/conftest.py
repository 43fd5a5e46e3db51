"""Fixtures shared by the admin browser tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.admin.browser import screenshot_dir


@pytest.fixture(scope="session")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where screenshots go: a temporary directory unless $CONSUMERDEDUP_SCREENSHOTS says."""
    return screenshot_dir(tmp_path_factory)
