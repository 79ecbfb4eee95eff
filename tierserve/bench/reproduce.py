"""`tierserve bench reproduce`: every policy on the same seeded workloads, in simulation.

The engine runs with explicit per-step limits (vLLM V1's A100 defaults unless told
otherwise), the same for every policy. Open-loop cells arrive (Poisson or bursty) at
fractions of the workload's capacity, which the bench measures first (fcfs saturated);
closed-loop cells have N clients that think between requests; trace workloads replay at
their own timestamps. results.json, report.md and the plots go to --out.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from tierserve.bench.cell import SIM_MODES, BenchSetup, Pattern
from tierserve.bench.limits import DEFAULT_LIMITS, NAMED_LIMITS, engine_limits
from tierserve.bench.matrix import Group, Matrix
from tierserve.cli_args import int_between, non_negative_int, out_path, positive_float, positive_int
from tierserve.config import EngineConfig
from tierserve.scheduling.registry import BENCH_POLICIES

DEFAULT_POLICIES = BENCH_POLICIES  # the baselines and hybrid, from the policy registry
LOAD_FRACTIONS = (0.5, 0.8, 1.0, 1.2, 1.5)
MIN_LOAD, MAX_LOAD = 0.001, 1000.0  # --loads, times capacity
MAX_THINK_TIME_S = 86_400.0
MAX_BURST_CV = 16.0
# Counts past these ran for hours or filled memory before saying anything (10^8 clients:
# 1.7 GB and still at 0 % after 25 s).
MAX_CLIENTS = 100_000  # closed-loop clients
MAX_REQUESTS = 1_000_000  # measured requests per cell and seed
CLIENTS = (32, 64, 128, 256, 512)
# The full matrix, sized to run in 30 minutes on two cores (docs/benchmark.md, "The matrix and
# how it is sized").
FULL_PLAN: tuple[tuple[str, Pattern, tuple[float, ...]], ...] = (
    ("default", "poisson", LOAD_FRACTIONS),
    ("default", "bursty", (0.8, 1.2)),
    ("default", "closed", (32, 128, 256, 512)),
    ("memory-pressure", "poisson", (0.5, 1.0, 1.5)),
    ("memory-pressure", "closed", (256, 512)),
)
QUICK_PLAN: tuple[tuple[str, Pattern, tuple[float, ...]], ...] = (
    ("default", "poisson", (0.8, 1.5)),
    ("default", "closed", (256,)),
    ("memory-pressure", "poisson", (1.5,)),
)
FULL_REQUESTS = 2200  # measured per seed: 3 seeds pool about 330 P0 requests (5 % of traffic)
QUICK_REQUESTS = 400
QUICK_CAPACITY_REQUESTS = 500


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "reproduce",
        help="every policy under open- and closed-loop load: SLO attainment, goodput, TTFT",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a few cells, small samples (under a minute: 19 s on a 2-core machine)",
    )
    p.add_argument(
        "--out",
        type=out_path,
        help="output directory (default: bench-out/reproduce, or bench-out/reproduce-quick with --quick, "
        "so that a quick run does not overwrite the whole matrix's results)",
    )
    p.add_argument(
        "--policies", nargs="+", help=f"policies to compare (default: {' '.join(DEFAULT_POLICIES)})"
    )
    p.add_argument(
        "--seed", type=non_negative_int, nargs="+", default=[0], help="workload seeds, pooled (default: 0)"
    )
    _add_cell_args(p)
    _add_engine_args(p)
    p.set_defaults(func=run)


def _add_cell_args(p: argparse.ArgumentParser) -> None:
    """Which workloads, arrival patterns and loads make the matrix's cells."""
    p.add_argument(
        "--workloads",
        nargs="+",
        help="default, memory-pressure, mooncake, azure-code, or a trace file (default: the full plan; "
        "default alone where a cell option is given, none where --trace is)",
    )
    p.add_argument(
        "--trace",
        nargs="+",
        metavar="FILE",
        help="trace files (an Azure or BurstGPT CSV, or Mooncake JSON lines) replayed at their own "
        "timestamps on the default hardware, beside --workloads where given, else alone",
    )
    p.add_argument(
        "--patterns",
        nargs="+",
        choices=("poisson", "bursty", "closed", "trace"),
        help="arrivals of the synthetic workloads (default: poisson closed)",
    )
    p.add_argument(
        "--loads", type=positive_float, nargs="+", help="open loop: fractions of capacity (0.001 to 1000)"
    )
    p.add_argument(
        "--clients",
        type=int_between(1, MAX_CLIENTS),
        nargs="+",
        help=f"closed loop: clients (at most {MAX_CLIENTS:,})",
    )
    p.add_argument(
        "--trace-scale", type=positive_float, nargs="+", help="trace: speed-up factors (default: 1)"
    )
    p.add_argument("--trace-rows", type=positive_int, help="trace: replay only the first N rows")
    p.add_argument(
        "--think-time", type=float, help="closed loop: mean think time, s (default: 2; at most a day)"
    )
    p.add_argument(
        "--burst-cv", type=float, help="bursty: CV of inter-arrival times (default: 4; at most 16)"
    )


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine every policy runs under, the sample sizes, and how the matrix is run."""
    p.add_argument(
        "--engine-limits",
        default=DEFAULT_LIMITS,
        choices=list(NAMED_LIMITS),
        help="per-step limits every policy runs under (default: %(default)s, vLLM V1's for an A100)",
    )
    p.add_argument(
        "--max-num-batched-tokens", type=positive_int, help="override the engine limits' token budget"
    )
    p.add_argument("--max-num-seqs", type=positive_int, help="override the engine limits' sequences")
    p.add_argument(
        "--requests",
        type=int_between(1, MAX_REQUESTS),
        help=f"measured requests per cell and seed (at most {MAX_REQUESTS:,})",
    )
    p.add_argument("--tier-mix", default="5/60/30/5", help="P0/P1/P2/P3 shares (default: %(default)s)")
    p.add_argument(
        "--drain-timeout", type=positive_float, default=900.0, help="virtual s after the last arrival"
    )
    p.add_argument("--config", help="engine config TOML (tiers; the limits above still apply)")
    p.add_argument(
        "--sim-mode",
        choices=SIM_MODES,
        default="fast",
        help="fast: leap over runs of decode steps (the same results, checked by `bench sim-speed`); "
        "step: every step (default: %(default)s)",
    )
    p.add_argument("--workers", type=positive_int, default=2, help="worker processes (default: %(default)s)")


def _groups(args: argparse.Namespace) -> tuple[Group, ...]:
    given = args.workloads or args.trace or args.patterns or args.loads or args.clients
    if not given:
        plan = QUICK_PLAN if args.quick else FULL_PLAN
        return tuple((w, p, float(x)) for w, p, loads in plan for x in loads)
    from tierserve.workloads import get_preset

    groups: list[Group] = []
    workloads = (args.workloads or ([] if args.trace else ["default"])) + (args.trace or [])
    # One given twice (--workloads and --trace, or one file by two paths) runs once.
    by_key: dict[str, str] = {}
    for w in workloads:
        by_key.setdefault(get_preset(w).trace_file or w, w)
    workloads = list(by_key.values())
    for workload in workloads:
        trace = get_preset(workload).trace_file is not None
        patterns: Sequence[Pattern] = ["trace"] if trace else (args.patterns or _implied_patterns(args))
        for pattern in patterns:
            if (pattern == "trace") != trace:
                raise ValueError(f"pattern {pattern} does not apply to workload {workload}")
            loads = {
                "trace": args.trace_scale or [1.0],
                "closed": args.clients or CLIENTS,
            }.get(pattern, args.loads or LOAD_FRACTIONS)
            if any(x <= 0 for x in loads):
                raise ValueError("loads, clients and trace scales must be positive")
            groups += [(workload, pattern, x) for x in dict.fromkeys(map(float, loads))]  # each once
    return tuple(groups)


def _implied_patterns(args: argparse.Namespace) -> list[Pattern]:
    """The synthetic workloads' arrivals when --patterns is not given: those the cell options
    name (`--loads 2` alone also ran every closed loop), else Poisson and closed loops."""
    named: list[Pattern] = []
    if args.loads is not None:
        named.append("poisson")
    if args.burst_cv is not None:
        named.append("bursty")
    if args.clients is not None or args.think_time is not None:
        named.append("closed")
    return named or ["poisson", "closed"]


def matrix_from_args(args: argparse.Namespace) -> Matrix:
    """Check the arguments and build the matrix; raises ValueError with a readable message."""
    from tierserve.scheduling.registry import POLICIES
    from tierserve.workloads import TierMix

    policies = tuple(dict.fromkeys(args.policies or DEFAULT_POLICIES))  # one given twice runs once
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {', '.join(unknown)}; choose from {', '.join(POLICIES)}")
    TierMix.parse(args.tier_mix)
    # Written so that nan fails too; inf ran every cell and then could not be written to
    # results.json (JSON has no inf).
    think_time = BenchSetup.think_time_s if args.think_time is None else args.think_time
    burst_cv = BenchSetup.burst_cv if args.burst_cv is None else args.burst_cv
    # Past these bounds virtual time stretches until a step's seconds vanish beside the
    # clock's (TTFTs of 0.0 s), or, for --burst-cv, the bench's few thousand arrivals no
    # longer offer the load they are labelled with (at a CV of 100, 4x it at the median).
    if not 0 <= think_time <= MAX_THINK_TIME_S:
        raise ValueError(f"--think-time must be 0 to {MAX_THINK_TIME_S:g} s (a day), got {think_time:g}")
    if not 0 < burst_cv <= MAX_BURST_CV:
        raise ValueError(f"--burst-cv must be > 0 and at most {MAX_BURST_CV:g}, got {burst_cv:g}")
    for load in args.loads or ():
        if not MIN_LOAD <= load <= MAX_LOAD:
            raise ValueError(f"--loads must be {MIN_LOAD:g} to {MAX_LOAD:g} times capacity, got {load:g}")
    setup = BenchSetup(
        limits=engine_limits(args.engine_limits, args.max_num_batched_tokens, args.max_num_seqs),
        tier_mix=args.tier_mix,
        num_measured=args.requests or (QUICK_REQUESTS if args.quick else FULL_REQUESTS),
        burst_cv=burst_cv,
        think_time_s=think_time,
        drain_timeout_s=args.drain_timeout,
        config_path=args.config,
        max_trace_rows=args.trace_rows,
        sim_mode=args.sim_mode,
    )
    if args.quick:
        setup = replace(setup, capacity_requests=QUICK_CAPACITY_REQUESTS)
    setup.engine_config()  # a bad config file fails now, not in a worker
    groups = _groups(args)
    _check_used(args, {pattern for _, pattern, _ in groups})
    return Matrix(setup, policies, tuple(args.seed), groups)


def _check_used(args: argparse.Namespace, patterns: set[str]) -> None:
    """Refuse a cell option that no cell of the matrix uses: `--patterns poisson --clients 4`
    ran the Poisson cells and left the clients out without a word, and `--trace-scale 2`
    without a trace ran the whole default matrix."""
    applies = {
        "--patterns": (args.patterns, ("poisson", "bursty", "closed")),  # traces replay their own
        "--loads": (args.loads, ("poisson", "bursty")),
        "--clients": (args.clients, ("closed",)),
        "--think-time": (args.think_time, ("closed",)),
        "--burst-cv": (args.burst_cv, ("bursty",)),
        "--trace-scale": (args.trace_scale, ("trace",)),
        "--trace-rows": (args.trace_rows, ("trace",)),
    }
    only_traces = patterns == {"trace"}
    for flag, (value, used_by) in applies.items():
        if value is not None and not patterns & set(used_by):
            hint = (
                " (only traces run, at their own timestamps: add --workloads default or memory-pressure)"
                if only_traces
                else ""
            )
            raise ValueError(f"{flag} applies to {' and '.join(used_by)} cells, and none runs{hint}")


# [scheduler] keys of a --config file that the engine limits replace (the same for every policy).
LIMIT_KEYS = ("max_num_batched_tokens", "max_num_seqs")


def config_not_read(path: str | None) -> list[str]:
    """The sections of a --config file that the bench does not read (a server's config given
    to it: its [server], [limits] and [tenants] were left out without a word), and as
    `scheduler.KEY` the [scheduler] keys that the engine limits replace (they were too)."""
    from tierserve.config import FOREIGN_SECTIONS, load_raw

    if path is None:
        return []
    raw = load_raw(path)
    unread = [section for section in FOREIGN_SECTIONS if section in raw]
    scheduler = raw.get("scheduler")
    if isinstance(scheduler, dict):
        unread += [f"scheduler.{key}" for key in LIMIT_KEYS if key in scheduler]
    return unread


def check_traces(matrix: Matrix) -> list[str]:
    """Read every trace the matrix replays (up to its row limit): a missing or malformed one
    fails before any cell runs, not after the cells before it. Returns a line for each trace
    saying what was read (`span_line`), to print once nothing else can fail first."""
    from tierserve.workloads.traces import check_span, span_line

    said: dict[str, str] = {}
    for workload, _, scale in (g for g in matrix.groups if g[1] == "trace"):
        rows = matrix.setup.trace_rows(workload)  # read once (cached)
        check_span(Path(workload), rows, scale)
        said.setdefault(workload, span_line(Path(workload), rows))
    return list(said.values())


def setup_json(matrix: Matrix, quick: bool) -> dict[str, Any]:
    from tierserve.bench.output import source_commit
    from tierserve.workloads import get_preset
    from tierserve.workloads.trace_stream import num_cut_to_fit
    from tierserve.workloads.traces import span_s

    s = matrix.setup
    config = s.engine_config()
    commit = source_commit()
    workloads = sorted({w for w, _, _ in matrix.groups})
    traces = [w for w in workloads if get_preset(w).trace_file]
    return {
        "simulated": "tierserve's engine, scheduler and KV memory on the roofline GPU simulator, "
        "in virtual time",
        "engine_limits": s.limits.as_json(),
        "workloads": {
            w: {"model": p.model, "gpu": p.gpu, "tp": p.tp, "traffic": p.description}
            for w in workloads
            for p in [get_preset(w)]
        },
        "policies": list(matrix.policies),
        "seeds": list(matrix.seeds),
        "tier_mix": s.tier_mix,
        "measured_requests_per_cell_and_seed": s.num_measured,
        **(
            {
                # A trace's first tenth warms up; the measured count is what rows are left.
                "trace_measured": "each trace's rows after its first tenth, at most the count above",
                "trace_rows": s.max_trace_rows or "all",
                # What each trace gave: the rows read and their span at 1x (a trace read in the
                # wrong time unit shows here).
                "trace_rows_read": {w: len(s.trace_rows(w)) for w in traces},
                "trace_span_s": {w: span_s(s.trace_rows(w)) for w in traces},
                # Rows longer than the model's context run shortened: not the trace's requests.
                "trace_rows_cut_to_context": {
                    w: num_cut_to_fit(s.trace_rows(w), s.executor(w).spec.max_model_len) for w in traces
                },
            }
            if traces
            else {}
        ),
        "think_time_s": s.think_time_s,
        "burst_cv": s.burst_cv,
        "drain_timeout_s": s.drain_timeout_s,
        "ttft_targets_s": {
            t.name: (None if c.ttft_target_s == float("inf") else c.ttft_target_s)
            for t, c in config.tiers.items()
        },
        # What else the engine ran with: a --config file's floors, weights or policy settings
        # changed the results and were written nowhere.
        "config": s.config_path or "built-in defaults",
        "config_sections_not_read": config_not_read(s.config_path),
        **engine_config_json(config, matrix.policies),
        "quick": quick,
        "sim_mode": s.sim_mode,
        "git_commit": commit,
    }


def engine_config_json(config: EngineConfig, policies: Sequence[str]) -> dict[str, Any]:
    """The engine settings every cell ran with: the scheduler's (with the engine limits),
    every tier's, and the own settings of each policy run that has any (its defaults where
    the config gives none). inf, which JSON lacks, is written as null: none, or never."""
    from tierserve.scheduling.registry import POLICIES

    def plain(obj: Any) -> dict[str, Any]:
        return {k: None if v == math.inf else v for k, v in asdict(obj).items()}

    options = {
        p: plain(config.options(p, options_type))
        for p in policies
        if (options_type := POLICIES[p].options_type) is not None
    }
    return {
        "scheduler": plain(config.scheduler),
        "tiers": {t.name: plain(c) for t, c in config.tiers.items()},
        "policy_options": options,
    }


def run(args: argparse.Namespace) -> int:
    from tierserve.bench import report
    from tierserve.bench.matrix import run_matrix
    from tierserve.bench.output import input_warnings, make_out_dir, release_out
    from tierserve.workloads.trace_stream import cut_note

    if args.out is None:
        args.out = "bench-out/reproduce-quick" if args.quick else "bench-out/reproduce"
    try:
        matrix = matrix_from_args(args)
        with input_warnings() as warned:  # the traces are read here, in this process
            read = check_traces(matrix)
        make_out_dir(Path(args.out))  # now: a bad --out must not cost the whole matrix
    except (ValueError, OSError) as e:
        print(f"tierserve bench reproduce: {e}", file=sys.stderr)
        return 2
    for line in read:
        print(line, file=sys.stderr)
    unread = config_not_read(args.config)
    sections = [u for u in unread if "." not in u]
    if sections:
        print(
            f"note: {args.config}: [{'], ['.join(sections)}] not read: the bench simulates the engine "
            "alone (a file's [tiers], [scheduler] and [policy] are read)",
            file=sys.stderr,
        )
    if len(sections) < len(unread):
        keys = ", ".join(u.partition(".")[2] for u in unread if "." in u)
        print(
            f"note: {args.config}: [scheduler] {keys} replaced by the engine limits, the same for "
            f"every policy ({matrix.setup.limits.label()}; set them with --engine-limits, "
            "--max-num-batched-tokens, --max-num-seqs)",
            file=sys.stderr,
        )
    started = time.monotonic()
    print(f"engine limits: {matrix.setup.limits.label()}", file=sys.stderr)
    if args.quick:
        print(
            "--quick: small samples (P0 figures rest on a few dozen requests; see the warnings)",
            file=sys.stderr,
        )
    setup = {**setup_json(matrix, args.quick), "input_warnings": warned}
    for workload, cut in setup.get("trace_rows_cut_to_context", {}).items():
        if cut:  # said in report.md too; a new user's trial found it only there
            print(f"note: {cut_note(cut, setup['trace_rows_read'][workload], workload)}", file=sys.stderr)
    results = {"setup": setup, **run_matrix(matrix, max(1, args.workers))}
    out = Path(args.out)
    written = report.write_all(out, results)
    release_out(out)
    print(report.summary_text(results))
    print(
        f"wrote {', '.join(str(p) for p in written)} in {time.monotonic() - started:.0f} s", file=sys.stderr
    )
    return 0
