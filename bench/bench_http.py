"""Requests/s through IdempotencyMiddleware next to the same endpoints without it.

Run it: ``.venv/bin/python bench/bench_http.py`` (``--quick`` for a smoke run). It needs
PostgreSQL (``CONSUMERDEDUP_BENCH_PG_URL``, default the local ``test`` database) and Redis
(``CONSUMERDEDUP_BENCH_REDIS_URL``, default ``redis://127.0.0.1:6379/0``). Its schema and
its Redis keys are fresh and deleted at the end.

One uvicorn server (one process, in a subprocess, on a socket this process binds) serves
every configuration side by side under its own path prefix, and one httpx client (``--clients``
concurrent connections, keep-alive) drives them all, round-robin, in the same run:

- ``POST /pay``: the business INSERT of one payment row in its own transaction, bare; through
  the middleware on the SQL store (PostgreSQL, a claim committed apart: unique keys, the
  claim's cost; replays, the hit's cost); in the transactional mode (the claim, the payment
  and the stored response in one transaction: the target is >= 0.8x of the bare endpoint);
  and 20 clients on 20 keys (each key sent by every client at once: one runs, the others get
  409 or the replay);
- ``POST /echo``: a JSON answer with no database, bare; through the middleware on the Redis
  store; and through asgi-idempotency-header (a peer, Redis; a dev dependency, installed
  without its redis extra, which pins redis<5), unique keys and replays for both; where it
  is not installed, the bench says so.

The client is httpx by default; ``--client raw`` (bench/raw_client.py, a minimal asyncio
HTTP/1.1 client) costs the CPUs a tenth as much, so on a small machine the server, not the
client, sets the rate. Besides the rates, the server's own CPU time per request (from
/proc) shows what the middleware costs whatever the client does.

Every scenario's effects are checked: the bare and unique-key runs add one payment per
request, replays and 409s add none, a key sent by 20 clients adds one. A figure is the median
of the rounds' rates with the slowest and fastest round, a ratio the ratio of two medians
(``bench/measure.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from sqlalchemy import create_engine, text

sys.path.insert(0, os.path.dirname(__file__))
from measure import (
    Conditions,
    Series,
    add_round_arguments,
    check_rounds,
    fmt,
    print_pairs,
    print_table,
)
from raw_client import RawConnection

PG_URL = os.environ.get(
    "CONSUMERDEDUP_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
REDIS_URL = os.environ.get("CONSUMERDEDUP_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
TRANSACTIONAL_TARGET = 0.8  # transactional mode / bare endpoint doing the same INSERT, at least
CONTENDED_KEYS = 20
START_TIMEOUT = 30.0

# The environment the server process reads its configuration from.
ENV_SCHEMA = "BENCH_HTTP_SCHEMA"
ENV_PREFIX = "BENCH_HTTP_REDIS_PREFIX"


# --------------------------------------------------------------------------- the server side


def peer_installed() -> bool:
    try:
        import idempotency_header_middleware  # noqa: F401
    except ImportError:
        return False
    return True


def make_server_app() -> Any:
    """The server process's ASGI app: one app per configuration, chosen by the first segment."""
    from http_apps import build  # bench/http_apps.py: only the server imports the web stack

    return build(
        PG_URL, REDIS_URL, os.environ[ENV_SCHEMA], os.environ[ENV_PREFIX], peer_installed()
    )


# --------------------------------------------------------------------------- the client side


class BenchFailed(Exception):
    """A check failed: the run's figures would mean nothing."""


@dataclass
class Scenario:
    name: str
    path: str
    keys: Callable[[int, str], list[str | None]]  # (requests, round tag) -> a key per request
    payments: Callable[[int], int]  # requests -> payments the scenario must add
    prime: bool = False  # send each distinct key once first (untimed): the timed part replays
    expect_replayed: bool = False
    statuses: frozenset[int] = frozenset({200, 201})
    rates: Series = field(default_factory=lambda: Series(""))
    server_cpu: Series = field(default_factory=lambda: Series(""))
    client_cpu: Series = field(default_factory=lambda: Series(""))
    seen: Counter[int] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.rates.name = self.server_cpu.name = self.client_cpu.name = self.name
        self.rates.unit = "req/s"
        for cpu in (self.server_cpu, self.client_cpu):
            cpu.unit, cpu.higher_is_better = "ms/req", False


def unique(requests: int, tag: str) -> list[str | None]:
    return [f"{tag}-{i}" for i in range(requests)]


def no_key(requests: int, tag: str) -> list[str | None]:
    return [None] * requests


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tag = uuid.uuid4().hex[:8]
        self.schema = f"bench_http_{self.tag}"
        self.prefix = f"bench-http-{self.tag}:"
        self.engine = create_engine(PG_URL)
        self.server: subprocess.Popen[bytes] | None = None
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in teardown)
        self.url = ""

    # ---- setup and teardown

    def setup(self) -> None:
        sys.path.insert(0, os.path.dirname(__file__))
        from http_apps import create_schema

        create_schema(self.engine, self.schema)
        self.start_server()

    def start_server(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1024)
        port = listener.getsockname()[1]
        env = {**os.environ, ENV_SCHEMA: self.schema, ENV_PREFIX: self.prefix}
        command = [sys.executable, "-m", "uvicorn", "bench_http:make_server_app", "--factory"]
        command += ["--app-dir", os.path.dirname(os.path.abspath(__file__))]
        command += ["--fd", str(listener.fileno()), "--log-level", "warning", "--no-access-log"]
        self.server = subprocess.Popen(
            command,
            pass_fds=[listener.fileno()],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        listener.close()  # the server holds its own copy
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.server.poll() is not None:
                raise SystemExit(f"BENCH FAILED: the server died:\n{self.server_log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.1)  # a poll of the server's port, not a wait for an outcome
        raise SystemExit(f"BENCH FAILED: the server did not answer:\n{self.server_log()}")

    def server_log(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]

    def teardown(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.terminate()
            try:
                self.server.wait(15)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait(5)
        from http_apps import drop_redis_keys, drop_schema

        drop_schema(self.engine, self.schema)
        drop_redis_keys(REDIS_URL, self.prefix)
        self.engine.dispose()

    # ---- the scenarios

    def scenarios(self) -> list[Scenario]:
        one_each = lambda n: n  # noqa: E731
        none = lambda n: 0  # noqa: E731
        replay_keys = lambda n, tag: [f"{tag}-{i % self.args.clients}" for i in range(n)]  # noqa: E731
        found = [
            Scenario(BARE_PAY, "/bare/pay", no_key, one_each),
            Scenario(SQL_UNIQUE, "/sql/pay", unique, one_each),
            Scenario(SQL_REPLAY, "/sql/pay", replay_keys, none, prime=True, expect_replayed=True),
            Scenario(TX_UNIQUE, "/tx/pay", unique, one_each),
            Scenario(TX_REPLAY, "/tx/pay", replay_keys, none, prime=True, expect_replayed=True),
            Scenario(
                CONTENDED,
                "/sql/pay",
                self.contended_keys,
                lambda n: CONTENDED_KEYS,
                statuses=frozenset({201, 409}),
            ),
            Scenario(BARE_ECHO, "/bare/echo", no_key, none),
            Scenario(REDIS_UNIQUE, "/redis/echo", unique, none),
            Scenario(
                REDIS_REPLAY, "/redis/echo", replay_keys, none, prime=True, expect_replayed=True
            ),
        ]
        if peer_installed():
            found += [
                Scenario(PEER_UNIQUE, "/peer/echo", unique, none),
                Scenario(
                    PEER_REPLAY, "/peer/echo", replay_keys, none, prime=True, expect_replayed=True
                ),
            ]
        return found

    def contended_keys(self, requests: int, tag: str) -> list[str | None]:
        """Each of the 20 keys ``--clients`` times in a row: the clients send it at once."""
        return [f"{tag}-{k}" for k in range(CONTENDED_KEYS) for _ in range(self.args.clients)]

    def server_cpu(self) -> float:
        """CPU seconds the server process has used (user + system, from /proc)."""
        assert self.server is not None
        with open(f"/proc/{self.server.pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def payments(self) -> int:
        with self.engine.connect() as conn:
            return int(
                conn.execute(text(f'SELECT count(*) FROM "{self.schema}".payments')).scalar()
            )

    def run(self) -> list[Scenario]:
        scenarios = self.scenarios()
        for round_ in range(-1, self.args.rounds):  # round -1: warm-up, not counted
            for number, scenario in enumerate(scenarios):
                n = self.args.warmup if round_ < 0 else self.args.requests
                tag = f"{self.tag}-{number}-{round_}"  # keys no other scenario or round sends
                keys = scenario.keys(n, tag)
                before = self.payments()
                if scenario.prime:
                    asyncio.run(self.send(scenario, sorted(set(keys), key=str), check=False))
                    before = self.payments()
                if round_ == 0:
                    scenario.seen.clear()  # count the measured rounds' answers only
                server_before, client_before = self.server_cpu(), time.process_time()
                started = time.perf_counter()
                asyncio.run(self.send(scenario, keys, check=True))
                elapsed = time.perf_counter() - started
                server_used = self.server_cpu() - server_before
                client_used = time.process_time() - client_before
                added = self.payments() - before
                if added != scenario.payments(n):
                    raise SystemExit(
                        f"BENCH FAILED: {scenario.name}: {added} payments, "
                        f"expected {scenario.payments(n)}"
                    )
                if round_ >= 0:
                    scenario.rates.add(len(keys) / elapsed)
                    scenario.server_cpu.add(server_used * 1000 / len(keys))
                    scenario.client_cpu.add(client_used * 1000 / len(keys))
                    if self.args.verbose:
                        print(f"  round {round_ + 1}: {scenario.name}: {len(keys) / elapsed:,.0f}")
        return scenarios

    async def send(self, scenario: Scenario, keys: list[str | None], check: bool) -> None:
        """Every request of ``keys`` in order over ``--clients`` concurrent connections."""
        body = json.dumps({"amount": 1, "pad": "x" * self.args.body_size}).encode()
        pending = iter(enumerate(keys))
        port = int(self.url.rsplit(":", 1)[1])
        raw = [RawConnection("127.0.0.1", port) for _ in range(self.args.clients)]
        limits = httpx.Limits(max_connections=self.args.clients)
        async with httpx.AsyncClient(base_url=self.url, limits=limits, timeout=60) as client:

            async def worker(connection: RawConnection) -> None:
                for _, key in pending:
                    headers = {"content-type": "application/json"}
                    if key is not None:
                        headers["idempotency-key"] = key
                    try:
                        if self.args.client == "raw":
                            answer: Any = await connection.post(scenario.path, body, headers)
                        else:
                            answer = await client.post(scenario.path, content=body, headers=headers)
                    except (httpx.TransportError, OSError, asyncio.IncompleteReadError) as error:
                        raise BenchFailed(f"{scenario.name}: {error!r}") from error
                    if check:
                        self.check(scenario, answer)

            try:
                await asyncio.gather(*(worker(connection) for connection in raw))
            finally:
                for connection in raw:
                    await connection.close()

    def check(self, scenario: Scenario, response: Any) -> None:
        """``response``: an httpx.Response or a raw_client.Answer (the same attributes)."""
        scenario.seen[response.status_code] += 1
        if response.status_code not in scenario.statuses:
            raise BenchFailed(f"{scenario.name}: HTTP {response.status_code} {response.text[:300]}")
        replayed = response.headers.get("idempotent-replayed") == "true"
        if scenario.expect_replayed and not replayed:
            raise BenchFailed(f"{scenario.name}: a response was not a replay")
        if scenario.keys is unique and replayed:
            raise BenchFailed(f"{scenario.name}: a fresh key was replayed")


BARE_PAY = "POST /pay, bare (INSERT, commit)"
SQL_UNIQUE = "SQL store (PostgreSQL), unique keys"
SQL_REPLAY = "SQL store (PostgreSQL), replays"
TX_UNIQUE = "transactional mode, unique keys"
TX_REPLAY = "transactional mode, replays"
CONTENDED = f"SQL store, {CONTENDED_KEYS} clients on {CONTENDED_KEYS} keys"
BARE_ECHO = "POST /echo, bare (no database)"
REDIS_UNIQUE = "Redis store, unique keys"
REDIS_REPLAY = "Redis store, replays"
PEER_UNIQUE = "asgi-idempotency-header, unique keys"
PEER_REPLAY = "asgi-idempotency-header, replays"


def print_conditions(args: argparse.Namespace, bench: Bench) -> Conditions:
    import redis
    import uvicorn

    conditions = Conditions()
    conditions.postgres(bench.engine)
    info = redis.Redis.from_url(REDIS_URL).info("server")
    conditions.add(
        "Redis",
        f"{info.get('redis_version', '?')} on this machine at {REDIS_URL}; redis-py "
        f"{redis.__version__}",
    )
    conditions.add(
        "server",
        f"uvicorn {uvicorn.__version__}, one process on this machine (the client, PostgreSQL "
        "and Redis share the same CPUs), access log off",
    )
    conditions.add(
        "client",
        (
            f"httpx {httpx.__version__} AsyncClient"
            if args.client == "httpx"
            else "raw asyncio HTTP/1.1 (bench/raw_client.py)"
        )
        + f", {args.clients} concurrent keep-alive connections, {args.requests} requests per "
        f"scenario per round, {args.rounds} round(s) round-robin after a warm-up of "
        f"{args.warmup}",
    )
    conditions.add("body", f"JSON, {args.body_size + 26} bytes, the same in every scenario")
    peer = "installed" if peer_installed() else "NOT INSTALLED: no comparison with the peer"
    conditions.add("peer", f"asgi-idempotency-header {peer}")
    conditions.print()
    return conditions


def print_results(scenarios: Sequence[Scenario], client_name: str) -> bool:
    by = {s.name: s.rates for s in scenarios}
    pay = [s.rates for s in scenarios if s.path.endswith("/pay")]
    echo = [s.rates for s in scenarios if s.path.endswith("/echo")]
    print_table("POST /pay (one payment INSERT)", pay, by[BARE_PAY], "vs bare")
    print_table("POST /echo (no database)", echo, by[BARE_ECHO], "vs bare")
    # What the middleware costs the server itself, whatever the client and the machine do:
    # on a busy 2-core machine the rates above include the client's share of the CPUs.
    cpu = {s.name: s.server_cpu for s in scenarios}
    print_table(
        "Server CPU per request (uvicorn process, user + system; lower is better)",
        [s.server_cpu for s in scenarios],
    )
    print_table(
        f"Client CPU per request ({client_name}, this process: the share the client takes)",
        [s.client_cpu for s in scenarios],
    )
    contended = next(s for s in scenarios if s.name == CONTENDED)
    print(
        f"{CONTENDED}: responses {dict(sorted(contended.seen.items()))} "
        f"(each key ran once: {CONTENDED_KEYS} payments a round)\n"
    )
    pairs = [
        ("SQL store, unique keys (a claim)", by[SQL_UNIQUE], by[BARE_PAY]),
        ("SQL store, replays (a hit)", by[SQL_REPLAY], by[BARE_PAY]),
        ("transactional mode, unique keys", by[TX_UNIQUE], by[BARE_PAY]),
        ("Redis store, unique keys", by[REDIS_UNIQUE], by[BARE_ECHO]),
        ("Redis store, replays", by[REDIS_REPLAY], by[BARE_ECHO]),
    ]
    print_pairs(
        "Through the middleware / without it (same endpoint, same server and client)", pairs
    )
    print("Server CPU per request, through the middleware / without it (> 1: it costs more)")
    for label, ours, bare in [
        ("SQL store, unique keys", cpu[SQL_UNIQUE], cpu[BARE_PAY]),
        ("SQL store, replays", cpu[SQL_REPLAY], cpu[BARE_PAY]),
        ("transactional mode, unique keys", cpu[TX_UNIQUE], cpu[BARE_PAY]),
        ("Redis store, unique keys", cpu[REDIS_UNIQUE], cpu[BARE_ECHO]),
        ("Redis store, replays", cpu[REDIS_REPLAY], cpu[BARE_ECHO]),
    ]:
        print(
            f"  {label:<32} {fmt(ours.median):>6} / {fmt(bare.median):>6} ms/req = "
            f"{ours.median / bare.median:.2f}x"
        )
    print()
    if PEER_UNIQUE in by:
        print_pairs(
            "Redis store / asgi-idempotency-header (both on Redis, POST /echo)",
            [
                ("unique keys", by[REDIS_UNIQUE], by[PEER_UNIQUE]),
                ("replays", by[REDIS_REPLAY], by[PEER_REPLAY]),
            ],
        )
    else:
        print("asgi-idempotency-header is not installed: no comparison with the peer\n")
    checks = [
        (
            f"transactional mode >= {TRANSACTIONAL_TARGET} x the bare endpoint",
            by[TX_UNIQUE].ratio(by[BARE_PAY]),
            by[TX_UNIQUE].ratio(by[BARE_PAY]) >= TRANSACTIONAL_TARGET,
        ),
        (
            "a replay is faster than running the endpoint (SQL store)",
            by[SQL_REPLAY].ratio(by[SQL_UNIQUE]),
            by[SQL_REPLAY].ratio(by[SQL_UNIQUE]) > 1,
        ),
    ]
    print("Targets")
    width = max(len(c[0]) for c in checks)
    for label, ratio, ok in checks:
        print(f"  {'PASS' if ok else 'MISS'}  {label:<{width}}  {ratio:6.2f}x")
    print()
    return all(ok for _, _, ok in checks)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, help="per scenario per round (default 2000)")
    parser.add_argument("--warmup", type=int, help="requests per scenario (default 200)")
    parser.add_argument("--clients", type=int, default=20, help="concurrent connections")
    parser.add_argument(
        "--client",
        choices=("httpx", "raw"),
        default="httpx",
        help="httpx (default), or raw: a minimal asyncio HTTP/1.1 client (bench/raw_client.py) "
        "that leaves the CPUs to the server",
    )
    parser.add_argument("--body-size", type=int, default=200, help="padding in the JSON body")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every round")
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 when a target is missed (default: 0)"
    )
    add_round_arguments(parser)
    args = parser.parse_args()
    check_rounds(parser, args)
    args.requests = args.requests or (100 if args.quick else 2000)
    args.warmup = args.warmup or (20 if args.quick else 200)
    bench = Bench(args)
    conditions = print_conditions(args, bench)
    try:
        bench.setup()
        scenarios = bench.run()
    except BenchFailed as failure:
        print(bench.server_log(), file=sys.stderr)
        raise SystemExit(f"BENCH FAILED: {failure}") from None
    finally:
        bench.teardown()
    ok = print_results(scenarios, args.client)
    conditions.print_after()
    return 1 if args.strict and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
