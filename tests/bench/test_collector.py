"""Simulations run with the cyclic garbage collector paused, and make no cycles per request.

The pause is safe only while what a run leaves to the cyclic collector does not grow with
its requests: reference counting must free every request, record and block the run lets go
of. (A run's engine and workload stream may sit in a cycle or two, once per run; they are
freed once the pause is lifted.) Each test runs a short and a three times longer workload
with the collector paused, keeps what a collection then finds, and compares the two: the
same objects, type by type.
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Callable, Iterator

import pytest

from tests.bench.test_driver import make_engine, small_stream
from tests.fleet.helpers import build_engine, specs
from tierserve.bench.collector import collector_paused
from tierserve.bench.driver import DriverConfig, run_workload
from tierserve.fleet.sim import FleetConfig, FleetSim
from tierserve.workloads.spec import RequestSpec


def _cyclic_garbage(run: Callable[[], object]) -> Counter[str]:
    """The objects, by type, that only the cyclic collector would free after `run`."""
    gc.collect()  # whatever earlier tests left
    gc.set_debug(gc.DEBUG_SAVEALL)  # from here on, what any collection finds is kept
    try:
        run()  # lifting the pause may set off a collection at once
        gc.collect()
        return Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def _noting_the_collector(stream: Iterator[RequestSpec], seen: list[bool]) -> Iterator[RequestSpec]:
    for spec in stream:
        seen.append(gc.isenabled())  # the run pulls its specs as it goes
        yield spec


def test_the_pause_is_lifted_after_the_block_and_left_to_the_outermost() -> None:
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block does not lift the outer one's pause
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("a failed run")
    assert gc.isenabled()


def test_a_fleet_run_is_paused_and_makes_no_cycles_per_request() -> None:
    seen: list[bool] = []

    def fleet(num_requests: int) -> Callable[[], object]:
        workload = specs(num_requests, seed=3, gap_s=0.2, prompt=(50, 900), output=(5, 60))
        sim = FleetSim(FleetConfig(2, router="tier-aware", kills=((3.0, 0),)), build_engine)
        return lambda: sim.run(_noting_the_collector(iter(workload), seen))

    short, long = _cyclic_garbage(fleet(30)), _cyclic_garbage(fleet(90))
    assert long == short
    assert len(seen) == 120 and not any(seen)  # paused for the whole of both runs
    assert gc.isenabled()


def test_a_single_engine_run_is_paused_and_makes_no_cycles_per_request() -> None:
    seen: list[bool] = []

    def single(num_measured: int) -> Callable[[], object]:
        engine, clock = make_engine()
        config = DriverConfig(num_measured=num_measured, concurrency=8)
        stream = _noting_the_collector(small_stream(2 * num_measured), seen)
        return lambda: run_workload(engine, clock, stream, config)

    short, long = _cyclic_garbage(single(20)), _cyclic_garbage(single(60))
    assert long == short
    assert seen and not any(seen)
    assert gc.isenabled()
