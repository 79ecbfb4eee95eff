"""`tierserve bench overhead`: CPU time of one scheduling pass under a large backlog.

The engine runs on a virtual clock with the trivial executor, so everything measured is
the scheduler itself: `num_running` requests decoding, `num_waiting` spread over the four
tiers, and KV memory as the binding limit (so admission, reclaim and aging all run).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from typing import Any

from tierserve.bench.host import HostMonitor
from tierserve.cli_args import int_between, positive_int
from tierserve.clock import VirtualClock
from tierserve.config import EngineConfig, SchedulerConfig
from tierserve.engine import Engine
from tierserve.executors.null import NullExecutor
from tierserve.request import Request, SamplingParams
from tierserve.scheduling import POLICIES
from tierserve.tiers import ALL_TIERS

BLOCK = 16
PROMPT_TOKENS = 128
TIER_SHARES = (0.05, 0.60, 0.30, 0.05)
STEP_TOKENS = 16384  # a step's token budget: one token for each running request and more


def measure(
    policy: str, num_running: int, num_waiting: int, num_passes: int, seed: int = 0
) -> dict[str, Any]:
    rng = random.Random(seed)
    # Room for `num_running` prompts plus the decode growth over the run, and no more.
    blocks_each = -(-(PROMPT_TOKENS + num_passes + 64) // BLOCK)
    max_tokens = blocks_each * BLOCK - PROMPT_TOKENS  # nobody finishes while we measure
    executor = NullExecutor(
        num_device_blocks=int(num_running * blocks_each / 0.85),  # P0's floor stays free
        num_host_blocks=num_running * blocks_each,
        block_size=BLOCK,
        max_model_len=1 << 20,
    )
    executor.record = False
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=num_running, max_num_batched_tokens=STEP_TOKENS)
    )
    clock = VirtualClock()
    engine = Engine(config, policy, executor, clock)
    engine.time_schedule = True
    serial = 0

    def submit(n: int) -> None:
        nonlocal serial
        for _ in range(n):
            tier = rng.choices(ALL_TIERS, TIER_SHARES)[0]
            prompt = [rng.randrange(50000) for _ in range(PROMPT_TOKENS)]
            engine.add_request(
                Request(
                    f"r{serial}",
                    prompt,
                    SamplingParams(max_tokens=max_tokens),
                    tier=tier,
                    arrival_time=clock.now(),
                )
            )
            serial += 1

    submit(num_running + num_waiting)
    for _ in range(10 * num_running):  # fill the running set
        if engine.num_running() >= num_running:
            break
        engine.step()
    samples = []
    for _ in range(num_passes):
        submit(max(0, num_running + num_waiting - engine.num_running() - engine.num_waiting()))
        engine.step()
        samples.append(engine.stats.last_schedule_cpu_s * 1e6)
    samples.sort()
    assert engine.stats.num_rejected == 0, "the backlog must be admissible"
    return {
        "schedule_us_p50": statistics.median(samples),
        "schedule_us_p99": samples[min(len(samples) - 1, int(0.99 * len(samples)))],
        "running": engine.num_running(),
        "waiting": engine.num_waiting(),
        "preemptions": engine.stats.num_preemptions(),
    }


def run(args: argparse.Namespace) -> int:
    policies = list(dict.fromkeys(args.policies or POLICIES))  # a policy named twice is measured once
    for name in policies:
        if name not in POLICIES:
            known = ", ".join(POLICIES)
            print(f"tierserve bench overhead: unknown policy {name!r}; choose from {known}", file=sys.stderr)
            return 2
    results = {}
    monitor = HostMonitor()
    width = max(map(len, policies))
    for name in policies:
        results[name] = measure(name, args.running, args.waiting, args.passes)
        if not args.json:
            r = results[name]
            print(
                f"{name:<{width}} p50 {r['schedule_us_p50']:8.0f} us   p99 {r['schedule_us_p99']:8.0f} us   "
                f"running {r['running']:4d}  waiting {r['waiting']:6d}  preemptions {r['preemptions']}",
                flush=True,
            )
    host = monitor.finish()
    if args.json:
        print(
            json.dumps(
                {
                    "running": args.running,
                    "waiting": args.waiting,
                    "passes": args.passes,
                    "policies": results,
                    "host": host.as_dict(),
                },
                indent=2,
            )
        )
    elif host.warning():
        print(host.warning())
    return 0


def _running(text: str) -> int:
    """--running: each running request decodes a token a step, so no more than the budget."""
    value = positive_int(text)
    if value > STEP_TOKENS:
        raise argparse.ArgumentTypeError(
            f"expected at most {STEP_TOKENS} (one decode token each within a step's budget), got {value}"
        )
    return value


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "overhead",
        help="CPU time of one scheduling pass, per policy",
        description="Measure the CPU time one scheduling pass takes with --running requests running and "
        "--waiting queued over the four tiers, for each policy. The engine runs on a virtual clock with a "
        "model that does no work, and memory is the binding limit, so only the scheduler is timed "
        "(admission, reclaim and aging included). The report says when the host was busy.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--running",
        type=_running,
        default=512,
        help=f"running requests, at most {STEP_TOKENS} (a step's token budget; default 512)",
    )
    p.add_argument(
        "--waiting",
        type=int_between(0, 1_000_000),
        default=10_000,
        help="waiting requests, at most 1,000,000 (default 10000)",
    )
    p.add_argument(
        "--passes",
        type=int_between(1, 1_000_000),
        default=300,
        help="scheduling passes measured per policy, at most 1,000,000 (default 300)",
    )
    p.add_argument(
        "--policies",
        nargs="+",
        metavar="POLICY",
        help=f"policies to measure, of {', '.join(POLICIES)} (default: all)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)
