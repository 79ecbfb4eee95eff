"""A workload's capacity: the request rate fcfs sustains on it, found by saturating it.

fcfs runs the workload closed-loop with twice as many clients as the engine has sequence
slots and no think time, so a queue is always waiting; the capacity is the measured
requests that finished divided by the measurement window. Open-loop loads are fractions of it.
"""

from __future__ import annotations

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
    num_requests: int  # finished requests it rests on

    def as_json(self) -> dict[str, float | int | str]:
        return {
            "workload": self.workload,
            "requests_per_s": round(self.requests_per_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "num_requests": self.num_requests,
            "how": f"{CAPACITY_POLICY}, closed loop, {CLIENTS_PER_SEQ} x max_num_seqs clients, no think time",
        }


def measure_capacity(
    workload: str, bench: BenchSetup, seed: int, num_measured: int | None = None
) -> Capacity:
    """fcfs's saturated throughput on `workload`."""
    config, executor = bench.engine_config(), bench.executor(workload)
    clock = VirtualClock()
    engine = Engine(config, CAPACITY_POLICY, executor, clock)
    clients = CLIENTS_PER_SEQ * config.scheduler.max_num_seqs
    driver = DriverConfig(
        num_measured=num_measured or bench.capacity_requests,
        num_warmup=clients,
        concurrency=clients,
        drain_timeout_s=3600.0,
    )
    result = run_workload(engine, clock, bench.stream(workload, seed, executor.spec.max_model_len), driver)
    window = result.window
    # Every request that finished inside the window counts, measured or not: the window
    # lasts as long as the slowest measured request, and the engine stays full all along.
    done = sum(
        1
        for r in result.records
        if r.status is RequestStatus.FINISHED and window.start_s < r.finish_s <= window.end_s
    )
    span = window.duration_s
    if span <= 0 or done == 0:
        raise RuntimeError(f"{workload}: the saturating run finished nothing")
    return Capacity(workload, done / span, result.window.num_generated_tokens / span, done)
