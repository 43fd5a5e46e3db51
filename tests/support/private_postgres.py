"""A throwaway PostgreSQL server of the test's own, for settings that need a server start.

``max_locks_per_transaction`` is read only at server start, and the shared server every
test and agent uses must not be restarted nor have its lock table filled (every other
transaction on it would then fail with "out of shared memory"). So a test that needs a
small lock table gets a server of its own: ``initdb`` into a temporary directory, started
on a free loopback port with the settings given, stopped and deleted afterwards. It needs
the PostgreSQL server binaries (``pg_config --bindir``, else /usr/lib/postgresql/*/bin),
present wherever the shared server runs; as root, the server runs as the ``postgres`` user.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest


def _bindir() -> Path | None:
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        found = subprocess.run(
            ["pg_config", "--bindir"], capture_output=True, text=True, check=True
        ).stdout.strip()
        if (Path(found) / "initdb").exists():
            return Path(found)
    for candidate in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if (Path(candidate) / "initdb").exists():
            return Path(candidate)
    return None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def private_postgres(settings: Mapping[str, str | int]) -> Iterator[str]:
    """A server started with ``settings`` (``-c name=value``); yields its psycopg URL."""
    bindir = _bindir()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (initdb) for a private server")
    as_user: list[str] = []
    root = tempfile.mkdtemp(prefix="cd-private-pg-")
    if os.geteuid() == 0:  # initdb and postgres refuse to run as root
        if shutil.which("runuser") is None:
            shutil.rmtree(root, ignore_errors=True)
            pytest.skip("running as root without runuser: cannot start a private server")
        as_user = ["runuser", "-u", "postgres", "--"]
        shutil.chown(root, "postgres")
    data = Path(root) / "data"
    port = _free_port()
    options = [f"-p {port}", f"-k {root}", "-c listen_addresses=127.0.0.1", "-c fsync=off"]
    options += [f"-c {name}={value}" for name, value in settings.items()]
    ctl = [*as_user, str(bindir / "pg_ctl"), "-D", str(data)]
    try:
        initdb = [str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"]
        subprocess.run(
            [*as_user, *initdb, "--no-sync"],
            check=True,
            capture_output=True,
        )
        subprocess.run(
            [*ctl, "-o", " ".join(options), "-l", str(Path(root) / "log"), "-w", "start"],
            check=True,
            capture_output=True,
        )
        try:
            yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
        finally:
            subprocess.run([*ctl, "-m", "immediate", "-w", "stop"], capture_output=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
