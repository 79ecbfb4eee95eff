"""The benchmark matrix: which cells run, in two worker processes, and results.json.

A job is one (workload, pattern, load, policy) over every seed, run in one worker: it
returns each seed's summary and the summary pooled over the seeds, so only figures cross
between processes. Capacities (fcfs's saturated request rate, one per workload that runs
open loop) are measured first: synthetic open-loop rates are fractions of them, and each
open-loop cell's offered load (a trace's too) is reported against them.
"""

from __future__ import annotations

import multiprocessing
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tierserve.bench.capacity import Capacity, measure_capacity
from tierserve.bench.cell import BenchSetup, Cell, Pattern, run_cell
from tierserve.bench.summary import add_throughput_vs_fcfs, summarize
from tierserve.workloads import get_preset

Group = tuple[str, Pattern, float]  # workload, pattern, load


@dataclass(frozen=True)
class Matrix:
    setup: BenchSetup
    policies: tuple[str, ...]
    seeds: tuple[int, ...]
    groups: tuple[Group, ...]

    def __post_init__(self) -> None:
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be distinct and at least one, got {list(self.seeds)}")
        if not self.policies or not self.groups:
            raise ValueError("the matrix needs at least one policy and one cell")

    def open_loop_workloads(self) -> list[str]:
        """The workloads whose capacity the bench measures: open-loop loads are fractions of
        it, and a trace's offered load is reported against it."""
        return sorted({w for w, p, _ in self.groups if p in ("poisson", "bursty", "trace")})


@dataclass(frozen=True)
class _Job:
    setup: BenchSetup
    group: Group
    policy: str
    seeds: tuple[int, ...]

    def weight(self) -> float:
        """A rough cost, to start the heaviest jobs first."""
        _, pattern, load = self.group
        return load / 256 if pattern == "closed" else load


def _run_job(job: _Job) -> tuple[_Job, list[dict[str, Any]], dict[str, Any]]:
    config = job.setup.engine_config()
    results = [run_cell(job.setup, Cell(*job.group, job.policy, seed)) for seed in job.seeds]
    return job, [summarize([r], config) for r in results], summarize(results, config)


def _capacity(args: tuple[str, BenchSetup, int]) -> Capacity | None:
    """The workload's capacity; None for a trace too short to saturate the engine (its
    offered load is then not reported; a synthetic workload always has enough)."""
    workload = args[0]
    trace = get_preset(workload).trace_file is not None
    try:
        return measure_capacity(*args, whole_turnover=trace)
    except RuntimeError as e:
        if not trace:
            raise
        print(f"{e}; offered load not reported", file=sys.stderr)
        return None


def _pool_map(fn: Callable[[Any], Any], items: Sequence[Any], workers: int) -> Any:
    if workers > 1 and len(items) > 1:
        # Ctrl-C reaches the whole process group: the workers leave it to this process, which
        # stops them (each printed half a traceback of its own KeyboardInterrupt).
        pool = multiprocessing.get_context("fork").Pool(
            min(workers, len(items)), initializer=signal.signal, initargs=(signal.SIGINT, signal.SIG_IGN)
        )
        try:
            yield from pool.imap_unordered(fn, items)
        finally:
            pool.terminate()
            pool.join()
    else:
        yield from map(fn, items)


def measure_capacities(matrix: Matrix, workers: int) -> dict[str, Capacity]:
    items = [(w, matrix.setup, matrix.seeds[0]) for w in matrix.open_loop_workloads()]
    return {c.workload: c for c in _pool_map(_capacity, items, workers) if c is not None}


def run_matrix(matrix: Matrix, workers: int = 2, progress: bool = True) -> dict[str, Any]:
    """Run every cell of `matrix`; return the results.json document (without `setup`)."""
    from tierserve.bench.output import progress_bar

    capacities = measure_capacities(matrix, workers)
    for c in capacities.values():
        print(
            f"capacity of {c.workload}: {c.requests_per_s:.3f} requests/s "
            f"({c.tokens_per_s:.0f} output tokens/s; fcfs saturated, {c.num_requests} requests)",
            file=sys.stderr,
        )
    setup = replace(matrix.setup, capacity_rps={w: c.requests_per_s for w, c in capacities.items()})
    jobs = [_Job(setup, g, p, matrix.seeds) for g in matrix.groups for p in matrix.policies]
    jobs.sort(key=lambda j: -j.weight())
    runs: list[dict[str, Any]] = []
    pooled: list[dict[str, Any]] = []
    # Closed however the loop ends: on Ctrl-C the bar is drawn before "interrupted", not after.
    with progress_bar(total=len(jobs), desc="bench", unit="run", disable=not progress) as bar:
        for _job_done, per_seed, merged in _pool_map(_run_job, jobs, workers):
            runs += per_seed
            pooled.append(merged)
            bar.update()
    order = {
        (g, p): k for k, (g, p) in enumerate((j.group, j.policy) for j in sorted(jobs, key=_order(matrix)))
    }
    runs.sort(key=lambda r: (order[_key(r)], str(r["seed"])))
    pooled.sort(key=lambda r: order[_key(r)])
    add_throughput_vs_fcfs(runs)
    add_throughput_vs_fcfs(pooled)
    return {
        "capacity": {w: c.as_json() for w, c in capacities.items()},
        "runs": runs,
        "pooled": pooled,
    }


def _key(run: dict[str, Any]) -> tuple[Group, str]:
    return (run["workload"], run["pattern"], float(run["load"])), run["policy"]


def _order(matrix: Matrix) -> Callable[[_Job], tuple[int, int]]:
    def key(job: _Job) -> tuple[int, int]:
        return matrix.groups.index(job.group), matrix.policies.index(job.policy)

    return key
