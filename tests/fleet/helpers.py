"""Small fleets of the `default` deployment for tests."""

from __future__ import annotations

import random

from tierserve.bench.cell import BenchSetup
from tierserve.clock import VirtualClock
from tierserve.engine import Engine
from tierserve.executors.sim.executor import build_sim_executor
from tierserve.tiers import ALL_TIERS
from tierserve.workloads.spec import RequestSpec

SETUP = BenchSetup()
CONFIG = SETUP.engine_config()


def build_engine(clock: VirtualClock) -> Engine:
    return Engine(CONFIG, "hybrid", build_sim_executor("llama-3.1-70b", "a100-80gb", 8), clock)


def specs(
    num: int, seed: int, gap_s: float, prompt: tuple[int, int], output: tuple[int, int]
) -> list[RequestSpec]:
    """Seeded open-loop specs: random tiers, unique prompts, arrivals `gap_s` apart on average."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(num):
        t += rng.expovariate(1.0 / gap_s)
        tier = rng.choice(ALL_TIERS)
        tokens = tuple(rng.randrange(1000, 100_000) for _ in range(rng.randint(*prompt)))
        out.append(RequestSpec(i, tier, f"t{int(tier)}", tokens, rng.randint(*output), arrival_s=t))
    return out
