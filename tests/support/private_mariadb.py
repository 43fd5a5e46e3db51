"""A throwaway MariaDB server of the test's own, for settings read only at server start.

The binary log (``log_bin``) cannot be switched on in a running server, and the shared
server every test and agent uses must not be restarted: a test that needs it gets a
server of its own, ``mariadb-install-db`` into a temporary directory, ``mariadbd``
started on a free loopback port with the options given, stopped (its process, by id)
and deleted afterwards. It needs the server binaries (present wherever the shared
server runs); as root, the server runs as the ``mysql`` user. About a second to start.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

INSTALL_DB = "mariadb-install-db"
SERVER = "/usr/sbin/mariadbd"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _answers(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
        return True
    return False


@contextlib.contextmanager
def private_mariadb(options: Sequence[str] = ()) -> Iterator[str]:
    """A server started with ``options`` (``--name=value``); yields the PyMySQL URL of its
    empty database ``test`` (root, no password)."""
    if shutil.which(INSTALL_DB) is None or not Path(SERVER).exists():
        pytest.skip(f"no MariaDB server binaries ({INSTALL_DB}, {SERVER}) for a private server")
    root = tempfile.mkdtemp(prefix="cd-private-mariadb-")
    user = ["--user=mysql"] if os.geteuid() == 0 else []
    if user:
        shutil.chown(root, "mysql")
    data = Path(root) / "data"
    port = _free_port()
    server: subprocess.Popen[bytes] | None = None
    try:
        subprocess.run(
            [INSTALL_DB, "--no-defaults", f"--datadir={data}", *user,
             "--auth-root-authentication-method=normal", "--skip-test-db"],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        server = subprocess.Popen(
            [SERVER, "--no-defaults", f"--datadir={data}", *user, f"--port={port}",
             "--bind-address=127.0.0.1", f"--socket={root}/sock", f"--pid-file={root}/pid",
             "--skip-name-resolve", "--innodb-buffer-pool-size=32M",
             f"--log-error={root}/error.log", *options],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while not _answers(port):  # polling a condition: the server listens
            log = Path(root) / "error.log"
            assert server.poll() is None, log.read_text() if log.exists() else "exited"
            assert time.monotonic() < deadline, "the private MariaDB did not listen in 60s"
            time.sleep(0.05)
        import pymysql

        with contextlib.closing(pymysql.connect(host="127.0.0.1", port=port, user="root")) as c:
            c.cursor().execute("CREATE DATABASE test CHARACTER SET utf8mb4")
        yield f"mysql+pymysql://root@127.0.0.1:{port}/test"
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(30)
        shutil.rmtree(root, ignore_errors=True)
