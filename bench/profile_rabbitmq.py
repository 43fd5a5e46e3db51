"""Where the RabbitMQ runner's CPU goes, per part, next to the hand-written loop.

Run it: ``.venv/bin/python bench/profile_rabbitmq.py [--scenario runner|by-hand|alone]``
(the services of bench_rabbitmq.py). It drains ``--messages`` fresh messages through one
scenario of bench_rabbitmq.py (batch 100, per-message handler) under cProfile timed by
``time.process_time`` and prints the CPU a message costs per part: each function's own
time goes to the part its file belongs to; the time of a function of no part (builtins,
the standard library) goes to the part of whoever called it.

cProfile inflates call-heavy code (about 1 us a Python call here): read the parts against
each other, and the totals against the bench's own CPU column, not as absolute costs.

``--split``: no profiler; ``time.process_time`` around the runner's parts instead (the
pika loop and ack, convert, the pipeline's steps, the guard's pieces, SQLAlchemy's and
psycopg's share of the handler's statement), each part's own CPU a message, its timed
children and their clock reads taken off (see TREE). ``--no-profile``: the CPU alone.
Both also print the garbage collector's CPU.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
import bench_rabbitmq
import psycopg

PARTS: list[tuple[str, str]] = [  # (a piece of the file's path, the part), the first that fits
    ("/pika/", "pika (consume, ack, frames)"),
    ("/adapters/rabbitmq/", "runner's own (adapters/rabbitmq)"),
    ("consumerdedup/lifecycle", "runner's own (adapters/rabbitmq)"),
    ("dedup/processing.py", "processor (processing.py)"),
    ("dedup/handler_guard.py", "guard (handler_guard, listeners, raw_commit, driver_state)"),
    ("dedup/guard_listeners.py", "guard (handler_guard, listeners, raw_commit, driver_state)"),
    ("dedup/raw_commit.py", "guard (handler_guard, listeners, raw_commit, driver_state)"),
    ("dedup/driver_state.py", "guard (handler_guard, listeners, raw_commit, driver_state)"),
    ("dedup/handler_kinds.py", "guard (handler_guard, listeners, raw_commit, driver_state)"),
    ("dedup/ops.py", "guard (handler_guard, listeners, raw_commit, driver_state)"),
    ("consumerdedup/db/control_sql", "guard (handler_guard, listeners, raw_commit, driver_state)"),
    ("dedup/deduplicator.py", "driver (deduplicator, driver_sql, transaction_start, db/)"),
    ("dedup/driver_sql.py", "driver (deduplicator, driver_sql, transaction_start, db/)"),
    ("dedup/transaction_start.py", "driver (deduplicator, driver_sql, transaction_start, db/)"),
    ("consumerdedup/db/", "driver (deduplicator, driver_sql, transaction_start, db/)"),
    ("/consumerdedup/dedup/", "pipeline (pipeline, states, records, statements)"),
    ("/consumerdedup/", "consumerdedup other (message, outcome, telemetry)"),
    ("/sqlalchemy/", "SQLAlchemy"),
    ("/psycopg/", "psycopg"),
    ("/psycopg_binary/", "psycopg"),
    ("bench_rabbitmq.py", "the bench (handler body, tally)"),
]


def part_of(filename: str) -> str | None:
    filename = "/" + filename  # py-spy names files relative to sys.path
    for piece, part in PARTS:
        if piece in filename:
            return part
    return None


def attribute(stats: pstats.Stats) -> dict[str, float]:
    """Own time per part; a function of no part hands its own time up to its callers."""
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    parts: dict[str, float] = defaultdict(float)

    def give(func: Any, seconds: float, depth: int) -> None:
        part = part_of(func[0])
        if part is not None:
            parts[part] += seconds
            return
        callers = raw[func][4] if func in raw else {}
        total = sum(edge[3] for edge in callers.values())  # cumulative time per caller edge
        if depth > 12 or not callers or total <= 0:
            parts["unattributed (" + (func[2] if part is None else part)[:40] + ")"] += seconds
            return
        for caller, edge in callers.items():
            give(caller, seconds * edge[3] / total, depth + 1)

    for func, (_cc, _nc, tottime, _ct, _callers) in raw.items():
        give(func, tottime, 0)
    return parts


class Timers:
    """CPU seconds (``time.process_time``) inside wrapped callables, by name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, owner: Any, attr: str, name: str, by: Callable[..., str] | None = None) -> None:
        fn = getattr(owner, attr)
        clock, seconds, calls = time.process_time, self.seconds, self.calls

        def timed(*args: Any, **kwargs: Any) -> Any:
            key = by(*args) if by is not None else name
            started = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[key] += clock() - started
                calls[key] += 1

        setattr(owner, attr, timed)


def split(bench: Any, timers: Timers) -> None:
    """Time the runner's parts (inclusive figures; ``report`` subtracts the nesting)."""
    from consumerdedup import Message
    from consumerdedup.adapters.rabbitmq import acks, runner
    from consumerdedup.dedup import deduplicator, guard_listeners, handler_guard
    from consumerdedup.dedup.pipeline import Pipeline

    def op_name(_self: Any, op: Any, _session: Any) -> str:
        return "op " + type(op).__name__

    def statement(_cursor: Any, query: Any, *_args: Any) -> str:
        ours = "processed_events" in str(query)
        return "psycopg: Cursor.execute (claim)" if ours else "psycopg: Cursor.execute"

    timers.wrap(psycopg.Cursor, "execute", "", by=statement)
    timers.wrap(psycopg.Connection, "commit", "psycopg: Connection.commit")
    timers.wrap(psycopg.Transaction, "__exit__", "psycopg: transaction exit (COMMIT)")
    timers.wrap(runner.RabbitConsumerRunner, "_consume", "consume loop")
    timers.wrap(runner.RabbitConsumerRunner, "_handle", "_handle")
    timers.wrap(runner, "to_message", "convert")
    timers.wrap(acks, "ack_all", "ack")
    timers.wrap(runner.RabbitConsumerRunner, "committed", "before_ack hook")
    timers.wrap(deduplicator.DedupHandler, "process_deliveries", "process_deliveries")
    timers.wrap(Pipeline, "start", "pipeline start")
    timers.wrap(deduplicator.DedupHandler, "_settle", "settle")
    timers.wrap(deduplicator.DedupHandler, "_carry_out", "", by=op_name)
    timers.wrap(deduplicator.DedupHandler, "_call", "guarded call")
    timers.wrap(deduplicator, "begin_checked", "begin_checked")
    timers.wrap(handler_guard.HandlerCall, "__init__", "guard: HandlerCall()")
    timers.wrap(handler_guard.HandlerCall, "finish", "guard: finish")
    timers.wrap(handler_guard.HandlerCall, "verify", "guard: verify")
    timers.wrap(deduplicator, "check_returned", "guard: check_returned")
    timers.wrap(handler_guard.HandlerCall, "before_statement", "guard: before_statement")
    timers.wrap(handler_guard.HandlerCall, "after_statement", "guard: after_statement")
    timers.wrap(bench.engine.dialect, "do_execute", "psycopg: execute (handler)")
    timers.wrap(bench.engine.dialect, "do_commit", "psycopg: commit")
    timers.wrap(guard_listeners.PipelineSession, "flush", "session.flush")
    timers.wrap(Message, "json", "message.json")
    timers.wrap(guard_listeners.PipelineSession, "execute", "session.execute")
    make_handler = bench.handler

    def handler(consumer: str) -> Any:
        made = make_handler(consumer)
        timers.wrap(made, "fn", "handler fn")
        return made

    bench.handler = handler


TREE: dict[str, list[str]] = {  # a timed call: the timed calls made inside it
    "consume loop": ["_handle"],
    "_handle": ["convert", "ack", "before_ack hook", "process_deliveries"],
    "process_deliveries": [
        "pipeline start",
        "settle",
        "begin_checked",
        "op Execute",
        "op Commit",
        "op CallHandler",
    ],
    "op Commit": ["psycopg: commit"],
    "op Execute": ["psycopg: Cursor.execute (claim)"],
    "psycopg: commit": ["psycopg: Connection.commit"],
    "psycopg: execute (handler)": ["psycopg: Cursor.execute"],
    "op CallHandler": ["guarded call"],
    "guarded call": [
        "guard: HandlerCall()",
        "guard: finish",
        "guard: verify",
        "guard: check_returned",
        "session.flush",
        "handler fn",
    ],
    "handler fn": ["session.execute", "message.json"],
    "session.execute": [
        "psycopg: execute (handler)",
        "guard: before_statement",
        "guard: after_statement",
    ],
}
LABELS = {
    "consume loop": "pika: consume (the runner's loop, process_data_events)",
    "ack": "pika: the multiple ack (its flush reads deliveries too)",
    "_handle": "runner: _handle (zip, outcomes, settled)",
    "convert": "runner: convert (to_message)",
    "before_ack hook": "the bench's before_ack hook (tally)",
    "process_deliveries": "pipeline+driver: process_deliveries (generator, _drive)",
    "pipeline start": "pipeline: start (Items, validate_id, payload_hash)",
    "settle": "driver: _settle (accounting)",
    "begin_checked": "driver: begin_checked",
    "op Execute": "driver+psycopg: our claim (op Execute)",
    "op Commit": "driver+SQLAlchemy: op Commit",
    "psycopg: commit": "psycopg: COMMIT",
    "op CallHandler": "driver: op CallHandler (_carry_out)",
    "guarded call": "guard: _guarded (handler_code, session.connection())",
    "guard: HandlerCall()": "guard: HandlerCall.__init__",
    "guard: finish": "guard: HandlerCall.finish",
    "guard: verify": "guard: HandlerCall.verify",
    "guard: check_returned": "guard: check_returned",
    "session.flush": "guard: session.flush after the handler",
    "handler fn": "the handler's own code (its dict, the call)",
    "message.json": "the handler's message.json()",
    "session.execute": "SQLAlchemy: session.execute of the handler's INSERT",
    "psycopg: execute (handler)": "guard: the guarded cursor's watch of the handler's INSERT",
    "psycopg: Cursor.execute": "psycopg: Cursor.execute of the business INSERT",
    "psycopg: Cursor.execute (claim)": "psycopg: Cursor.execute of the multi-row claim",
    "psycopg: Connection.commit": "psycopg: Connection.commit",
    "psycopg: transaction exit (COMMIT)": "psycopg: by hand, the transaction's COMMIT",
    "guard: before_statement": "guard: before_cursor_execute listener",
    "guard: after_statement": "guard: after_cursor_execute listener",
}


def calibrate() -> float:
    """CPU seconds one timed call adds to whoever encloses it."""
    timers, box = Timers(), type("Box", (), {"f": staticmethod(lambda: None)})
    timers.wrap(box, "f", "noop")
    calls = 20000
    started = time.process_time()
    for _ in range(calls):
        box.f()
    return (time.process_time() - started) / calls


def report(timers: Timers, n: int, cpu: float) -> None:
    """Each timed call's own CPU a message: its time minus its children's and their clocks."""
    cost = calibrate()
    seconds, calls = timers.seconds, timers.calls
    print(
        f"{n} messages, batch 100: {cpu / n * 1e6:.1f} us CPU a message with the timers "
        f"({cost * 1e6:.2f} us a timed call, taken off its parent)"
    )
    total = 0.0
    for name, label in LABELS.items():
        children = TREE.get(name, [])
        own = seconds.get(name, 0.0) - sum(seconds.get(c, 0.0) for c in children)
        own -= cost * sum(calls.get(c, 0) for c in children)
        total += own
        print(f"  {label:<62} {own / n * 1e6:7.1f} us/msg  ({calls.get(name, 0) / n:.2f}/msg)")
    print(f"  {'sum':<62} {total / n * 1e6:7.1f} us/msg")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--scenario", choices=("runner", "by-hand", "alone"), default="runner")
    parser.add_argument("--body-size", type=int, default=256)
    parser.add_argument("--dump", help="write the raw profile here (pstats)")
    parser.add_argument(
        "--split", action="store_true", help="no cProfile: timers around the runner's parts"
    )
    parser.add_argument(
        "--no-profile", action="store_true", help="no cProfile: CPU alone (for py-spy)"
    )
    args = parser.parse_args()
    args.rounds, args.warmup, args.verbose, args.quick = 1, 0, False, False
    bench = bench_rabbitmq.Bench(args)
    bench.setup()
    try:
        timers = Timers()
        if args.split:
            split(bench, timers)
            args.no_profile = True
        make = {"runner": bench.runner, "by-hand": bench.by_hand, "alone": bench.pipeline}
        drain = make[args.scenario](100)
        warm = bench.queue()
        bench.fill(warm, 200)
        drain(warm, 200)
        timers.seconds.clear()
        timers.calls.clear()
        queue = bench.queue() if args.scenario != "alone" else ""
        if queue:
            bench.fill(queue, args.messages)
        gc_cpu = [0.0, 0.0, 0]

        def on_gc(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                gc_cpu[1] = time.process_time()
            else:
                gc_cpu[0] += time.process_time() - gc_cpu[1]
                gc_cpu[2] += 1

        gc.callbacks.append(on_gc)
        profiler = cProfile.Profile(time.process_time)
        started = time.process_time()
        if not args.no_profile:
            profiler.enable()
        drain(queue, args.messages)
        profiler.disable()
        cpu = time.process_time() - started
        gc.callbacks.remove(on_gc)
        print(f"garbage collection: {gc_cpu[2]} runs, {gc_cpu[0] / args.messages * 1e6:.1f} us/msg")
    finally:
        bench.teardown()
    n = args.messages
    if args.split:
        report(timers, n, cpu)
        return
    if args.no_profile:
        print(f"{args.scenario}: {n} messages, batch 100, {cpu / n * 1e6:.1f} us CPU a message")
        return
    if args.dump:
        profiler.dump_stats(args.dump)
    parts = attribute(pstats.Stats(profiler))
    print(
        f"{args.scenario}: {n} messages, batch 100, {cpu / n * 1e6:.1f} us CPU a message "
        "under the profiler"
    )
    for part, seconds in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"  {part:<62} {seconds / n * 1e6:8.1f} us/msg")
    print(f"  {'sum':<62} {sum(parts.values()) / n * 1e6:8.1f} us/msg")


if __name__ == "__main__":
    main()
