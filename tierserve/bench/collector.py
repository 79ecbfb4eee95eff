"""Simulations run with Python's cyclic garbage collector paused.

A simulation allocates containers by the million (token lists, the prefix cache's block
records, step outputs), and the collector, which runs on allocation counts, scans every
live container each time it does. On the Mooncake trace's long prompts that was about a
fifth of a fleet run's CPU: for 2,500 requests on 16 replicas, 4,801 young, 436 middle
and 23 full collections, the full ones ~150 ms each, 6.5 s of 34.6 s; the run took 25.7 s
without them. A simulation makes no reference cycles per request (a run's engine and
workload stream may sit in one or two, freed once the pause is lifted), so reference
counting frees what it lets go of as it goes; tests/bench/test_collector.py checks that
what a run leaves to the collector does not grow with its requests.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic collector for the block (nested blocks leave it to the outermost)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
