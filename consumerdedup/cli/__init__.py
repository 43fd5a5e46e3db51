"""The ``consumerdedup`` command (``consumerdedup.cli:main`` is its entry point)."""

from .main import main

__all__ = ["main"]
