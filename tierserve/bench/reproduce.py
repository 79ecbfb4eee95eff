"""`tierserve bench reproduce`: the source article's benchmark (DESIGN.md §7), in simulation.

Every policy runs the same seeded workload at every load on `Engine` + the GPU simulator
in virtual time; results.json, report.md and ttft_p95.png go to --out.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierserve.scheduling.registry import BENCH_POLICIES

if TYPE_CHECKING:  # keep the command cheap to import
    from tierserve.config import EngineConfig
    from tierserve.executors.base import Executor
    from tierserve.workloads.spec import RequestSpec

DEFAULT_POLICIES = BENCH_POLICIES  # the baselines and hybrid, from the policy registry
DEFAULT_CONCURRENCY = (32, 64, 128, 256, 512)
QUICK_CONCURRENCY = (32, 128)
DEFAULT_RATES_RPS = (5.0, 10.0, 20.0)
WARMUP_WAVES = 3
MIN_P0_MEASURED = 120  # P0 is 5 % of traffic: its P95 needs enough samples
QUICK_MEASURED = 200
BASELINE_POLICY = "fcfs"  # one request at a time: the policy has nothing to choose


@dataclass(frozen=True)
class Load:
    label: str
    concurrency: int | None = None  # closed loop
    rate_rps: float | None = None  # open loop, synthetic arrivals
    rate_scale: float | None = None  # open loop, trace arrivals

    def fields(self) -> dict[str, Any]:
        return {
            "load": self.label,
            "concurrency": self.concurrency,
            "rate_rps": self.rate_rps,
            "rate_scale": self.rate_scale,
        }


@dataclass(frozen=True)
class Sweep:
    """Everything that decides the results (and nothing that does not)."""

    model: str = "llama-3.1-70b"
    gpu: str = "a100-80gb"
    tp: int = 8
    seed: int = 0
    policies: tuple[str, ...] = DEFAULT_POLICIES
    loads: tuple[Load, ...] = tuple(Load(str(c), concurrency=c) for c in DEFAULT_CONCURRENCY)
    trace: str | None = None
    burst_cv: float = 1.0
    tier_mix: str = "5/60/30/5"
    num_measured: int = 2400
    num_warmup: int | None = None  # None: the concurrency (closed loop) or 10 % of the measured (open)
    drain_timeout_s: float = 1800.0
    config_path: str | None = None
    # Every client's request may run at once, so KV memory, not a seat cap, is the limit
    # (in the article, no priority runs out of memory at 512).
    max_num_seqs: int | None = 512
    extra_setup: Mapping[str, Any] = field(default_factory=dict)

    def warmup(self, load: Load) -> int:
        if self.num_warmup is not None:
            return self.num_warmup
        # Closed loop: the first wave of N requests all arrive at t = 0, a burst the engine
        # needs a while to absorb; three waves put the measurement in the steady state.
        return WARMUP_WAVES * load.concurrency if load.concurrency is not None else self.num_measured // 10

    def fit_trace(self, num_rows: int) -> Sweep:
        """This sweep with as many measured requests as fit in the trace after the warm-up."""

        def fits(num_measured: int) -> bool:
            sweep = replace(self, num_measured=num_measured)
            return num_measured + max(sweep.warmup(load) for load in self.loads) <= num_rows

        if not fits(1):
            raise ValueError(f"{self.trace}: {num_rows} rows leave nothing to measure after the warm-up")
        low, high = 1, self.num_measured  # fits(low); m + warm-up(m) grows with m
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if fits(mid) else (low, mid - 1)
        return replace(self, num_measured=low)

    def engine_config(self) -> EngineConfig:
        from tierserve.config import EngineConfig, load_config

        config = load_config(self.config_path) if self.config_path else EngineConfig()
        if self.max_num_seqs is not None:
            config = replace(config, scheduler=replace(config.scheduler, max_num_seqs=self.max_num_seqs))
        return config

    def workload(self, max_model_len: int, load: Load) -> Iterator[RequestSpec]:
        from tierserve.workloads import TierMix, load_trace, synthetic_stream, trace_stream, with_arrivals

        mix = TierMix.parse(self.tier_mix)
        if self.trace:
            return trace_stream(load_trace(self.trace), self.seed, max_model_len, mix, load.rate_scale or 1.0)
        stream = synthetic_stream(self.seed, max_model_len, mix)
        return with_arrivals(stream, load.rate_rps, self.burst_cv, self.seed) if load.rate_rps else stream


ExecutorFactory = Callable[[Sweep], "Executor"]


def sim_executor(sweep: Sweep) -> Executor:
    from tierserve.executors.sim import build_sim_executor

    executor: Executor = build_sim_executor(sweep.model, sweep.gpu, sweep.tp)
    return executor


@dataclass(frozen=True)
class _Job:
    sweep: Sweep
    factory: ExecutorFactory
    policy: str
    load: Load | None  # None: the concurrency-1 P0 baseline


def _run_job(job: _Job) -> tuple[_Job, Any]:
    from tierserve.bench.driver import DriverConfig, run_workload
    from tierserve.bench.metrics import run_metrics
    from tierserve.clock import VirtualClock
    from tierserve.engine import Engine
    from tierserve.tiers import Tier

    sweep, executor = job.sweep, job.factory(job.sweep)
    config, clock = sweep.engine_config(), VirtualClock()
    engine = Engine(config, job.policy, executor, clock)
    if job.load is None:
        # P0 alone, one request at a time, up to the last measured index of any load.
        last = max(sweep.warmup(load) for load in sweep.loads) + sweep.num_measured
        any_load = sweep.loads[0]
        specs = (
            s
            for s in _until(sweep.workload(executor.spec.max_model_len, any_load), last)
            if s.tier is Tier.P0
        )
        result = run_workload(
            engine, clock, specs, DriverConfig(num_measured=last, concurrency=1, drain_timeout_s=math.inf)
        )
        return job, {
            r.index: r.first_token_s - r.arrival_s for r in result.records if r.first_token_s is not None
        }
    driver = DriverConfig(
        num_measured=sweep.num_measured,
        num_warmup=sweep.warmup(job.load),
        concurrency=job.load.concurrency,
        drain_timeout_s=sweep.drain_timeout_s,
    )
    result = run_workload(engine, clock, sweep.workload(executor.spec.max_model_len, job.load), driver)
    extra = {
        "seed": sweep.seed,
        "submitted": len(result.records),
        "accounted": True,  # the driver asserts it
        "engine_steps": result.stats.num_steps,
        "virtual_end_s": round(result.end_s, 6),
        "engine_preemptions": {
            "swap": result.stats.num_preemptions("swap"),
            "recompute": result.stats.num_preemptions("recompute"),
        },
    }
    return job, (run_metrics(result.records, result.window, config), extra)


def _until(specs: Iterator[RequestSpec], end_index: int) -> Iterator[RequestSpec]:
    for spec in specs:
        if spec.index >= end_index:
            return
        yield spec


def _baseline_p95(ttfts: Mapping[int, float], start: int, end: int) -> float | None:
    from tierserve.bench.metrics import percentile

    return percentile([t for i, t in ttfts.items() if start <= i < end], 95)


def run_sweep(
    sweep: Sweep, factory: ExecutorFactory = sim_executor, workers: int = 2, progress: bool = True
) -> dict[str, Any]:
    """Run every (policy, load) and the baseline; return the results.json document."""
    from tqdm import tqdm

    from tierserve.bench.report import run_entry

    jobs = [_Job(sweep, factory, BASELINE_POLICY, None)]
    # Heaviest loads first, so that no long run is left alone at the end.
    for load in sorted(sweep.loads, key=lambda ld: -(ld.concurrency or ld.rate_rps or ld.rate_scale or 0)):
        jobs += [_Job(sweep, factory, policy, load) for policy in sweep.policies]
    done: dict[tuple[str, str | None], Any] = {}
    bar = tqdm(total=len(jobs), desc="reproduce", unit="run", file=sys.stderr, disable=not progress)
    if workers > 1 and len(jobs) > 1:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(min(workers, len(jobs))) as pool:
            for job, out in pool.imap_unordered(_run_job, jobs):
                done[(job.policy, job.load.label if job.load else None)] = out
                bar.update()
    else:
        for job in jobs:
            out = _run_job(job)[1]
            done[(job.policy, job.load.label if job.load else None)] = out
            bar.update()
    bar.close()
    baseline: dict[int, float] = done[(BASELINE_POLICY, None)]
    runs = []
    for policy in sweep.policies:
        for load in sweep.loads:
            metrics, extra = done[(policy, load.label)]
            start = sweep.warmup(load)
            runs.append(
                run_entry(
                    policy,
                    load.fields(),
                    metrics,
                    _baseline_p95(baseline, start, start + sweep.num_measured),
                    extra,
                )
            )
    return {"setup": _setup(sweep, factory), "runs": runs}


def run_seeds(
    sweep: Sweep, seeds: Sequence[int], factory: ExecutorFactory = sim_executor, workers: int = 2
) -> dict[str, Any]:
    """`run_sweep` once per workload seed; the runs of every seed, each tagged with its seed."""
    if len(set(seeds)) != len(seeds) or not seeds:
        raise ValueError(f"seeds must be distinct and at least one, got {list(seeds)}")
    results = [run_sweep(replace(sweep, seed=s), factory, workers) for s in seeds]
    setup = dict(results[0]["setup"])
    if len(seeds) > 1:
        setup["seed"] = list(seeds)
    return {"setup": setup, "runs": [run for r in results for run in r["runs"]]}


def _setup(sweep: Sweep, factory: ExecutorFactory) -> dict[str, Any]:
    import subprocess

    from tierserve.workloads import TIER_ASSIGNMENT_RULE, TierMix

    spec = factory(sweep).spec
    config = sweep.engine_config()
    try:
        commit: str | None = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                cwd=Path(__file__).parent,
                check=True,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.CalledProcessError):
        commit = None
    closed = all(load.concurrency is not None for load in sweep.loads)
    return {
        "model": sweep.model,
        "gpu": sweep.gpu,
        "tp": sweep.tp,
        "workload": ("trace " + Path(sweep.trace).name if sweep.trace else "synthetic mixed-tier")
        + (", closed loop" if closed else ", open loop"),
        "seed": sweep.seed,
        "trace": sweep.trace,
        "policies": list(sweep.policies),
        "concurrencies": [load.concurrency for load in sweep.loads if load.concurrency is not None],
        "loads": [load.label for load in sweep.loads],
        "tier_mix": TierMix.parse(sweep.tier_mix).label(),
        "tier_assignment": TIER_ASSIGNMENT_RULE
        if sweep.trace
        else "tier drawn from the tier mix with the seed; "
        "lengths from the tier's distribution (docs/benchmark.md)",
        "measured_requests_per_run": sweep.num_measured,
        "warmup": f"the first {WARMUP_WAVES} x concurrency requests (closed loop) "
        "or 10 % of the measured (open loop)"
        if sweep.num_warmup is None
        else f"the first {sweep.num_warmup} requests",
        "drain_timeout_s": None if math.isinf(sweep.drain_timeout_s) else sweep.drain_timeout_s,
        "p0_baseline": f"the same workload's P0 requests alone at concurrency 1 ({BASELINE_POLICY})",
        "utilization": "sum of the simulator's roofline step times / elapsed virtual time, measured window",
        "kv_blocks": spec.num_device_blocks,
        "block_size": spec.block_size,
        "max_model_len": spec.max_model_len,
        "max_num_seqs": config.scheduler.max_num_seqs,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "ttft_targets_s": {
            t.name: (None if math.isinf(c.ttft_target_s) else c.ttft_target_s)
            for t, c in config.tiers.items()
        },
        "git_commit": commit,
        **sweep.extra_setup,
    }


def write_outputs(out_dir: Path, results: Mapping[str, Any]) -> list[Any]:
    """Write results.json, report.md and the plot; return the runs the report shows (one
    per policy and load, merged over the seeds)."""
    from tierserve.bench import report

    out_dir.mkdir(parents=True, exist_ok=True)
    report.write_json(out_dir / "results.json", results)
    summary = report.across_seeds(results["runs"])
    (out_dir / "report.md").write_text(report.markdown(results["setup"], summary))
    report.plot_ttft_p95(out_dir / "ttft_p95.png", summary, results["setup"]["ttft_targets_s"])
    return summary


# ---- the command ----------------------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "reproduce",
        help="the article's benchmark: P95 TTFT by policy and load",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="fewer requests and loads (about a minute)")
    p.add_argument("--out", default="bench-out/reproduce", help="output directory (default: %(default)s)")
    p.add_argument(
        "--trace", help="replay an Azure .csv or Mooncake .jsonl trace instead of synthetic traffic"
    )
    p.add_argument(
        "--open-loop",
        action="store_true",
        help="arrivals at given times (trace times, or --rate) instead of closed-loop clients",
    )
    p.add_argument(
        "--rate-scale",
        type=float,
        nargs="+",
        default=[1.0],
        help="open loop with --trace: replay arrivals this many times faster (default: 1)",
    )
    p.add_argument(
        "--rate",
        type=float,
        nargs="+",
        help="open loop without a trace: arrivals per second (default: 5 10 20)",
    )
    p.add_argument(
        "--burst-cv",
        type=float,
        default=1.0,
        help="open loop without a trace: CV of gamma inter-arrival times; 1 = Poisson",
    )
    p.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES))
    p.add_argument(
        "--concurrency", type=int, nargs="+", help="closed-loop clients (default: 32 64 128 256 512)"
    )
    p.add_argument(
        "--seed",
        type=int,
        nargs="+",
        default=[0],
        help="workload seed; with several, each runs in turn and the report shows medians (default: 0)",
    )
    p.add_argument("--model", default="llama-3.1-70b")
    p.add_argument("--gpu", default="a100-80gb")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--tier-mix", default="5/60/30/5", help="P0/P1/P2/P3 shares (default: %(default)s)")
    p.add_argument("--requests", type=int, help="measured requests per run (default: enough for 120 P0)")
    p.add_argument("--warmup", type=int, help="warm-up requests per run (default: 3 x the concurrency)")
    p.add_argument(
        "--drain-timeout",
        type=float,
        help="virtual seconds after the last measured arrival before the rest is aborted",
    )
    p.add_argument("--config", help="engine config TOML (default: built-in defaults)")
    p.add_argument(
        "--max-num-seqs", type=int, default=512, help="running sequences at most (default: %(default)s)"
    )
    p.add_argument("--workers", type=int, default=2, help="parallel runs (default: %(default)s)")
    p.set_defaults(func=run)


def sweep_from_args(args: argparse.Namespace) -> Sweep:
    """Check the arguments and build the sweep; raises ValueError with a readable message."""
    from tierserve.scheduling import POLICIES
    from tierserve.tiers import Tier
    from tierserve.workloads import TierMix, load_trace

    unknown = [p for p in args.policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {', '.join(unknown)}; choose from {', '.join(POLICIES)}")
    mix = TierMix.parse(args.tier_mix)
    if args.open_loop and args.trace:
        loads = tuple(Load(f"x{s:g}", rate_scale=s) for s in args.rate_scale)
    elif args.open_loop:
        loads = tuple(Load(f"{r:g} rps", rate_rps=r) for r in (args.rate or DEFAULT_RATES_RPS))
    else:
        default = QUICK_CONCURRENCY if args.quick else DEFAULT_CONCURRENCY
        loads = tuple(Load(str(c), concurrency=c) for c in (args.concurrency or default))
    if any(c < 1 for c in args.concurrency or ()) or any(
        x <= 0 for x in [*args.rate_scale, *(args.rate or ())]
    ):
        raise ValueError("concurrency, --rate and --rate-scale must be positive")
    p0_share = mix.shares[Tier.P0]
    measured = args.requests or (
        QUICK_MEASURED if args.quick else math.ceil(MIN_P0_MEASURED / p0_share) if p0_share > 0 else 2400
    )
    sweep = Sweep(
        model=args.model,
        gpu=args.gpu,
        tp=args.tp,
        seed=args.seed[0],
        policies=tuple(args.policies),
        loads=loads,
        trace=args.trace,
        burst_cv=args.burst_cv,
        tier_mix=args.tier_mix,
        num_measured=measured,
        num_warmup=args.warmup,
        drain_timeout_s=args.drain_timeout or 1800.0,
        config_path=args.config,
        max_num_seqs=args.max_num_seqs,
        extra_setup={"quick": bool(args.quick)},
    )
    sweep.engine_config()  # a bad config file fails now, not in a worker
    if args.trace:
        sweep = sweep.fit_trace(len(load_trace(args.trace)))
    return sweep


def run(args: argparse.Namespace) -> int:
    from tierserve.bench import report

    try:
        sweep = sweep_from_args(args)
    except (ValueError, OSError) as e:
        print(f"tierserve bench reproduce: {e}", file=sys.stderr)
        return 2
    started = time.monotonic()
    results = run_seeds(sweep, args.seed, workers=max(1, args.workers))
    out_dir = Path(args.out)
    summary = write_outputs(out_dir, results)
    print(report.tables(summary))
    print(report.targets_section(summary))
    print(
        f"wrote {out_dir / 'results.json'}, {out_dir / 'report.md'}, {out_dir / 'ttft_p95.png'} "
        f"in {time.monotonic() - started:.0f} s",
        file=sys.stderr,
    )
    return 0
