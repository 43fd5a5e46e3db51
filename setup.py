"""Packages are found, not listed: consumerdedup/ as it is, adapters/ as consumerdedup.adapters.

Everything else is in pyproject.toml. setuptools' own ``find`` cannot rename a
folder, and the adapters live outside the package (so that mypy and ruff see
them as the separate, optional code they are).
"""

from setuptools import find_packages, setup

ADAPTERS = "consumerdedup.adapters"

core = find_packages(include=["consumerdedup", "consumerdedup.*"])
adapters = [ADAPTERS, *(f"{ADAPTERS}.{name}" for name in find_packages("adapters"))]
setup(packages=core + adapters, package_dir={ADAPTERS: "adapters"})
