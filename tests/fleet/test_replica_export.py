"""A leaping replica leaves exported what a step-by-step replica exports at the same
boundary: the state the gateway's scrapes read."""

from __future__ import annotations

import math

from tests.fleet.helpers import CONFIG, specs
from tierserve.clock import VirtualClock
from tierserve.engine import Engine
from tierserve.executors.sim.executor import build_sim_executor
from tierserve.fleet.replica import Exported, Replica, ReplicaState
from tierserve.request import Request, SamplingParams


def _replica(fast: bool) -> Replica:
    def build(clock: VirtualClock) -> Engine:
        return Engine(CONFIG, "hybrid", build_sim_executor("llama-3.1-70b", "a100-80gb", 8), clock, fast=fast)

    replica = Replica("r0", build, 0.0)
    replica.state = ReplicaState.READY
    for spec in specs(12, seed=5, gap_s=0.01, prompt=(50, 400), output=(40, 120)):
        replica.send(
            Request(
                f"r{spec.index}",
                list(spec.prompt_token_ids),
                SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True),
                tier=spec.tier,
            )
        )
    return replica


def test_a_leap_exports_what_its_last_boundary_exports_step_by_step() -> None:
    step, fast = _replica(fast=False), _replica(fast=True)
    by_time: dict[float, Exported] = {}
    now = 0.0
    while now is not None:
        step.boundary(now)
        by_time[now] = step.exported
        now = step.next_boundary
    times = sorted(by_time)

    num_leaps, now = 0, 0.0
    while now is not None:
        steps_before = fast.engine.stats.num_leapt_steps
        fast.boundary(now, until=math.inf)
        if fast.engine.stats.num_leapt_steps > steps_before and fast.next_boundary is not None:
            num_leaps += 1
            # The last leapt step began at the step-by-step boundary just before this one.
            last_start = max(t for t in times if t < fast.next_boundary)
            assert fast.exported == by_time[last_start]
        now = fast.next_boundary
    assert num_leaps >= 3  # the check ran over several leaps
