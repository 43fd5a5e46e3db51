"""The cyclic garbage collector, once a consumer is set up: ``gc.freeze()``, once a process.

A consumer process keeps what it builds at start-up (modules, SQLAlchemy's compiled
statements and pools, the broker clients) for its whole life, and each full (generation
2) collection walks all of it again. A chunk's objects live for a whole database round
trip, so many outlive the young collections and make full ones come often: with the Kafka
runner and a bulk handler, 5-11 us of ~42 us of CPU a record went to them
(bench/profile_kafka_offsets.py), 0.3-0.9 us once the start-up objects are frozen.

``freeze_once()`` runs a full collection (what is garbage now is freed, not kept) and
moves every object that survives it to the permanent generation, where the collector
no longer looks (gc.freeze). It is safe: a frozen object is still freed by reference
counting as soon as nothing refers to it; only a reference cycle among objects alive at
that moment that later becomes garbage is not collected, a bounded amount taken once.
It is done once a process (a second runner, a restart of run(), a forked child find it
done), and not at all when the collector is disabled (``gc.disable()``: the process
manages it itself). ``gc.unfreeze()`` undoes it.

Where: each broker runner's ``run()``, once its set-up is done (the start checks, the
broker's clients connected) and before its first message. That is the end of start-up
for a ``consumerdedup run`` worker (its parts are runners, started in threads of one
process) and for a process that runs a runner by hand alike.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_frozen = False


def freeze_once() -> bool:
    """Collect, then freeze what survives, the first time in this process; True if it did."""
    global _frozen
    with _lock:
        if _frozen or not gc.isenabled():
            return False
        _frozen = True
        gc.collect()
        gc.freeze()
        return True
