"""The browser tests' screenshots leave the developer's tree alone unless asked:
pytest's temporary directory by default, ``$CONSUMERDEDUP_SCREENSHOTS`` (relative to the
repository) when set."""

from __future__ import annotations

import uuid

import pytest

from tests.admin.browser import REPOSITORY, SCREENSHOTS, screenshot_dir


def test_by_default_screenshots_go_to_a_temporary_directory(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SCREENSHOTS, raising=False)
    found = screenshot_dir(tmp_path_factory)
    assert found.is_relative_to(tmp_path_factory.getbasetemp())
    assert not found.is_relative_to(REPOSITORY)
    monkeypatch.setenv(SCREENSHOTS, "  ")  # blank is unset, not the repository's root
    assert screenshot_dir(tmp_path_factory).is_relative_to(tmp_path_factory.getbasetemp())


def test_the_variable_names_a_directory_of_the_repository(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"build/shots-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv(SCREENSHOTS, name)
    found = screenshot_dir(tmp_path_factory)
    try:
        assert found == REPOSITORY / name and found.is_dir()
    finally:
        found.rmdir()
