"""One benchmark cell: a policy on a workload at one load with one seed, simulated.

`BenchSetup` holds what every cell of a run shares (engine limits, tier mix, sample
sizes, the measured capacities); `run_cell` builds the engine, drives the workload and
returns the cell's samples (`CellResult`), from which `summary` computes its figures.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tierserve.bench.driver import DriverConfig, DriverResult, run_workload
from tierserve.bench.idle import IdleTtft
from tierserve.bench.limits import EngineLimits, engine_limits
from tierserve.clock import VirtualClock
from tierserve.config import EngineConfig, load_config
from tierserve.data_dir import data_path
from tierserve.engine import Engine
from tierserve.executors.sim.executor import SimExecutor, build_sim_executor
from tierserve.tiers import Tier
from tierserve.workloads import (
    RequestSpec,
    TierMix,
    TraceRecord,
    get_preset,
    load_trace,
    synthetic_stream,
    trace_stream,
    with_arrivals,
)

Pattern = Literal["poisson", "bursty", "trace", "closed"]
SimMode = Literal["fast", "step"]  # fast: leap over steady decode steps (same results)
SIM_MODES: tuple[SimMode, ...] = ("fast", "step")


@dataclass(frozen=True)
class BenchSetup:
    limits: EngineLimits = field(default_factory=engine_limits)
    tier_mix: str = "5/60/30/5"
    num_measured: int = 2000
    burst_cv: float = 4.0  # bursty arrivals: CV of the gamma inter-arrival times
    think_time_s: float = 2.0  # closed loop: mean exponential think time
    drain_timeout_s: float = 900.0
    config_path: str | None = None
    data_dir: str | None = None  # None: $TIERSERVE_DATA, else shared/data beside the repository
    capacity_rps: Mapping[str, float] = field(default_factory=dict)
    max_trace_rows: int | None = None
    capacity_requests: int = 1500  # measured requests of the saturating run that finds capacity
    sim_mode: SimMode = "fast"

    def engine_config(self) -> EngineConfig:
        base = load_config(self.config_path) if self.config_path else EngineConfig()
        return self.limits.apply(base)

    def executor(self, workload: str) -> SimExecutor:
        preset = get_preset(workload)
        return build_sim_executor(preset.model, preset.gpu, preset.tp)

    def trace_rows(self, workload: str) -> list[TraceRecord]:
        preset = get_preset(workload)
        if preset.trace_file is None:
            raise ValueError(f"workload {workload} is not a trace")
        path = Path(preset.trace_file)
        if not path.is_absolute():  # a named workload's trace, in the data folder; a file given is as given
            path = Path(self.data_dir) / path if self.data_dir else data_path(preset.trace_file)
        return load_trace(path, self.max_trace_rows)

    def stream(self, workload: str, seed: int, max_model_len: int) -> Iterator[RequestSpec]:
        """The workload's specs, without arrival times (a trace's at its own timestamps)."""
        preset, mix = get_preset(workload), TierMix.parse(self.tier_mix)
        if preset.trace_file is not None:
            return trace_stream(self.trace_rows(workload), seed, max_model_len, mix)
        if preset.shapes is None:
            raise ValueError(f"workload {workload} has neither shapes nor a trace")
        return synthetic_stream(seed, max_model_len, mix, preset.shapes)


@dataclass(frozen=True)
class Cell:
    workload: str
    pattern: Pattern
    load: float  # open: fraction of capacity (trace: rate scale); closed: clients
    policy: str
    seed: int

    @property
    def arrival(self) -> str:
        return "closed" if self.pattern == "closed" else "open"

    @property
    def group(self) -> tuple[str, str, float]:
        """The cells that differ only in policy and seed."""
        return (self.workload, self.pattern, self.load)


@dataclass(frozen=True)
class CellResult:
    cell: Cell
    run: DriverResult
    p0_idle_ttft_s: Mapping[int, float]  # measured P0 request index -> its TTFT alone
    num_device_blocks: int
    preemption_cost_s: Mapping[tuple[bool, int], float]  # (swapped, blocks or tokens) -> GPU seconds
    rate_rps: float | None  # open loop, synthetic: the arrival rate
    capacity_rps: float | None = None  # the workload's measured capacity, where it was measured


def _warmup(setup: BenchSetup, cell: Cell, num_rows: int | None = None) -> int:
    """One request per client (closed loop), else a tenth of the measured count, or of
    the trace's `num_rows` where the trace is shorter than that count."""
    if cell.pattern == "closed":
        return int(cell.load)
    return min(setup.num_measured, num_rows or setup.num_measured) // 10


def _driver_config(setup: BenchSetup, cell: Cell, num_measured: int, num_warmup: int) -> DriverConfig:
    closed = cell.pattern == "closed"
    return DriverConfig(
        num_measured=num_measured,
        num_warmup=num_warmup,
        concurrency=int(cell.load) if closed else None,
        drain_timeout_s=setup.drain_timeout_s,
        think_time_s=setup.think_time_s if closed else 0.0,
        seed=cell.seed,
        max_requests=(num_warmup + num_measured) * 13 // 10,
    )


@dataclass(frozen=True)
class Driven:
    """A cell's simulation, before the figures that need more than the run."""

    run: DriverResult
    p0_shapes: Mapping[int, tuple[int, int]]  # P0 spec index -> (prompt, history) tokens
    executor: SimExecutor
    rate_rps: float | None


def run_cell(setup: BenchSetup, cell: Cell) -> CellResult:
    return cell_result(setup, cell, drive(setup, cell))


def drive(setup: BenchSetup, cell: Cell) -> Driven:
    """Simulate the cell: build its engine (in `setup.sim_mode`) and run its workload."""
    config, executor = setup.engine_config(), setup.executor(cell.workload)
    clock = VirtualClock()
    engine = Engine(config, cell.policy, executor, clock, fast=setup.sim_mode == "fast")
    mml = executor.spec.max_model_len
    rate: float | None = None
    num_measured, num_warmup = setup.num_measured, _warmup(setup, cell)
    if cell.pattern == "trace":
        rows = setup.trace_rows(cell.workload)
        num_warmup = _warmup(setup, cell, len(rows))
        num_measured = max(1, min(num_measured, len(rows) - num_warmup))
        specs = trace_stream(rows, cell.seed, mml, TierMix.parse(setup.tier_mix), cell.load)
    else:
        specs = setup.stream(cell.workload, cell.seed, mml)
        if cell.pattern in ("poisson", "bursty"):
            rate = cell.load * setup.capacity_rps[cell.workload]
            cv = 1.0 if cell.pattern == "poisson" else setup.burst_cv
            specs = with_arrivals(specs, rate, cv, cell.seed)
    history: dict[int, tuple[int, int]] = {}
    result = run_workload(
        engine, clock, _noting_p0(specs, history), _driver_config(setup, cell, num_measured, num_warmup)
    )
    return Driven(result, history, executor, rate)


def cell_result(setup: BenchSetup, cell: Cell, driven: Driven) -> CellResult:
    """The cell's samples: the run, P0's idle TTFTs and the preemptions' costs."""
    result, history, executor = driven.run, driven.p0_shapes, driven.executor
    idle = _idle_ttft(cell.workload, setup.limits, setup.config_path)
    p0_idle = {r.index: idle(*history[r.index]) for r in result.records if r.measured and r.tier is Tier.P0}
    cost: dict[tuple[bool, int], float] = {}
    for p in (p for r in result.records if r.measured for p in r.preemptions):
        # A swap moves the blocks out and (later) back in; a recompute prefills the tokens again.
        seconds = (
            2 * executor.estimate_swap_s(p.amount) if p.swapped else executor.estimate_prefill_s(p.amount)
        )
        cost[(p.swapped, p.amount)] = seconds
    return CellResult(
        cell,
        result,
        p0_idle,
        executor.spec.num_device_blocks,
        cost,
        driven.rate_rps,
        setup.capacity_rps.get(cell.workload),
    )


@functools.lru_cache(maxsize=8)
def _idle_ttft(workload: str, limits: EngineLimits, config_path: str | None) -> IdleTtft:
    """One memo of idle TTFTs per set-up and process: every policy and seed of a workload
    asks for the same shapes (a pure function of its arguments, so sharing it is safe)."""
    setup = BenchSetup(limits=limits, config_path=config_path)
    return IdleTtft(setup.engine_config(), setup.executor(workload))


def _noting_p0(specs: Iterator[RequestSpec], shapes: dict[int, tuple[int, int]]) -> Iterator[RequestSpec]:
    """The specs, noting each P0 spec's (prompt, history) tokens by index."""
    for spec in specs:
        if spec.tier is Tier.P0:
            shapes[spec.index] = (spec.num_prompt_tokens, spec.num_history_tokens)
        yield spec
