"""A workload's capacity: the request rate fcfs sustains on it, found by saturating it.

fcfs runs the workload closed-loop with twice as many clients as the engine has sequence
slots and no think time, so a queue is always waiting, and stops once the last measured
request is sent (no request's length stretches the run). The capacity is the rate of
request completions after the start-up transient (the first `clients` completions) up to
the last one. Open-loop loads are fractions of it.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from tierserve.bench.cell import BenchSetup
from tierserve.bench.driver import DriverConfig, run_workload
from tierserve.clock import VirtualClock
from tierserve.engine import Engine
from tierserve.request import RequestStatus

CAPACITY_POLICY = "fcfs"
CLIENTS_PER_SEQ = 2


@dataclass(frozen=True)
class Capacity:
    workload: str
    requests_per_s: float
    tokens_per_s: float
    num_requests: int  # completions it rests on

    def as_json(self) -> dict[str, float | int | str]:
        return {
            "workload": self.workload,
            "requests_per_s": round(self.requests_per_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "num_requests": self.num_requests,
            "how": f"{CAPACITY_POLICY} saturated: closed loop, {CLIENTS_PER_SEQ} x max_num_seqs clients, "
            "no think time; completions per second after the start-up transient",
        }


def measure_capacity(
    workload: str,
    bench: BenchSetup,
    seed: int,
    num_measured: int | None = None,
    *,
    whole_turnover: bool = False,
) -> Capacity:
    """fcfs's saturated throughput on `workload`. `whole_turnover`: refuse a window with fewer
    completions than clients (a trace's rows can run out first: on a few hundred rows the
    window began inside the start-up transient and rested on a handful of requests, the
    rate 7-20 % off the long run's)."""
    config, executor = bench.engine_config(), bench.executor(workload)
    clock = VirtualClock()
    engine = Engine(config, CAPACITY_POLICY, executor, clock)
    clients = CLIENTS_PER_SEQ * config.scheduler.max_num_seqs
    driver = DriverConfig(
        num_measured=num_measured or bench.capacity_requests,
        num_warmup=clients,
        concurrency=clients,
        drain_timeout_s=0.0,  # stop when the last measured request is sent
    )
    result = run_workload(engine, clock, bench.stream(workload, seed, executor.spec.max_model_len), driver)
    ends = sorted(
        (r.finish_s, r.num_output_tokens) for r in result.records if r.status is RequestStatus.FINISHED
    )
    # The first `clients` ends are the start-up transient (every client's request arrived at
    # once); from then on the engine is saturated until the run stops.
    # The window opens at that end; the ends counted in it are those after it, not the ones
    # at the same instant (requests in lockstep finish in waves: counting the opening wave
    # over-stated the rate by a third).
    skip = min(clients, len(ends) // 2)
    start = ends[skip][0] if ends else 0.0
    span = ends[-1][0] - start if ends else 0.0
    done = ends[bisect.bisect_right(ends, (start, math.inf)) :]
    if span <= 0 or not done or (whole_turnover and len(done) < clients):
        raise RuntimeError(
            f"{workload}: too few requests finished to measure its capacity "
            f"({len(done)} past the start-up transient; {clients} needed)"
        )
    return Capacity(workload, len(done) / span, sum(n for _, n in done) / span, len(done))
