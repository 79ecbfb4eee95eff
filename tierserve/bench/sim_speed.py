"""`tierserve bench sim-speed`: the fast simulation against step-by-step, on one workload.

Runs the same cell (workload, arrival pattern, load, policy, seed) in both simulation
modes, times each run's CPU, and compares everything the bench reports: every request's
record (times, token counts, preemptions, outcome), the measurement window's counters
and the cell's summary (results.json's figures). `max_rel_diff` is the largest relative
difference between any two numbers of the two runs; a difference in anything that is not
a number (an outcome, a reason, a count of records) is counted in `mismatches`.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from tierserve.bench import host
from tierserve.bench.cell import BenchSetup, Cell, Driven, Pattern, cell_result, drive
from tierserve.bench.output import emit, make_out_folder
from tierserve.bench.reproduce import MAX_CLIENTS, MAX_REQUESTS, MAX_THINK_TIME_S
from tierserve.bench.summary import summarize
from tierserve.cli_args import int_between, non_negative_int, positive_int
from tierserve.scheduling import POLICIES
from tierserve.workloads import get_preset
from tierserve.workloads.trace_stream import cut_note, num_cut_to_fit
from tierserve.workloads.traces import check_span, span_line

DESCRIPTION = """\
Simulate one benchmark cell twice, step by step and in the fast mode (which keeps the
running decodes in aggregate and leaps over runs of steps in which every running request
decodes and nothing arrives), and report the simulated requests per CPU-second of each,
the speed-up, and the largest relative difference in any figure the two runs report (0
when they agree to the bit).
Default: the `default` workload, 256 closed-loop clients, policy hybrid."""


@dataclasses.dataclass(frozen=True)
class Comparison:
    max_rel_diff: float
    mismatches: int  # differences in anything that is not a number


def rel_diff(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if math.isnan(a) or math.isnan(b) or math.isinf(a) or math.isinf(b):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b))


def _leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(path, leaf) of every number, string or flag inside records, dicts and lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            yield from _leaves(value[key], f"{path}.{key}")
    elif isinstance(value, list | tuple):
        yield f"{path}#", len(value)
        for i, item in enumerate(value):
            yield from _leaves(item, f"{path}[{i}]")
    else:
        yield path, value.value if isinstance(value, enum.Enum) else value


def compare(a: Any, b: Any) -> Comparison:
    """How far two results are apart, leaf by leaf (same paths in the same order)."""
    worst, mismatches = 0.0, 0
    left, right = list(_leaves(a)), list(_leaves(b))
    if [p for p, _ in left] != [p for p, _ in right]:
        return Comparison(math.inf, max(1, abs(len(left) - len(right))))
    for (_, x), (_, y) in zip(left, right, strict=True):
        numbers = isinstance(x, int | float) and isinstance(y, int | float)
        if numbers and not isinstance(x, bool) and not isinstance(y, bool):
            worst = max(worst, rel_diff(float(x), float(y)))
        elif x != y:
            mismatches += 1
    return Comparison(worst, mismatches)


def compare_runs(setup: BenchSetup, cell: Cell, step: Driven, fast: Driven) -> Comparison:
    """Records, window and engine counters, then the cell's summary as results.json has it."""
    config = setup.engine_config()
    by_run = compare(_reported(step), _reported(fast))
    summaries = compare(
        summarize([cell_result(setup, cell, step)], config),
        summarize([cell_result(setup, cell, fast)], config),
    )
    return Comparison(
        max(by_run.max_rel_diff, summaries.max_rel_diff), by_run.mismatches + summaries.mismatches
    )


def _reported(driven: Driven) -> dict[str, Any]:
    run = driven.run
    stats = run.stats
    counters = {
        "num_steps": stats.num_steps,
        "num_generated_tokens": stats.num_generated_tokens,
        "busy_s": stats.busy_s,
        "roofline_s": stats.roofline_s,
        "preemptions": {f"{t.name}/{mode}": n for (t, mode), n in sorted(stats.preemptions.items())},
    }
    return {"records": run.records, "window": run.window, "end_s": run.end_s, "stats": counters}


def _timed(setup: BenchSetup, cell: Cell) -> tuple[Driven, float]:
    started = time.process_time()
    driven = drive(setup, cell)
    return driven, time.process_time() - started


def _say(repeat: int, repeats: int) -> None:
    """A line on stderr as each repeat starts (three repeats of the default cell take half a
    minute or more, and the terminal was blank)."""
    line = f"[bench sim-speed] repeat {repeat} of {repeats}: step mode, then fast ..."
    print(line, file=sys.stderr, flush=True)


def measure(setup: BenchSetup, cell: Cell, repeats: int = 1) -> dict[str, Any]:
    """Both modes `repeats` times, in turn; each mode's least CPU time counts (other jobs
    on the host only ever add to it). The first runs are compared."""
    _say(1, repeats)
    step, step_cpu = _timed(replace(setup, sim_mode="step"), cell)
    fast, fast_cpu = _timed(replace(setup, sim_mode="fast"), cell)
    for i in range(repeats - 1):
        _say(i + 2, repeats)
        step_cpu = min(step_cpu, _timed(replace(setup, sim_mode="step"), cell)[1])
        fast_cpu = min(fast_cpu, _timed(replace(setup, sim_mode="fast"), cell)[1])
    num_requests = len(step.run.records)
    comparison = compare_runs(setup, cell, step, fast)
    step_rate, fast_rate = num_requests / step_cpu, len(fast.run.records) / fast_cpu
    return {
        "workload": cell.workload,
        "pattern": cell.pattern,
        "load": cell.load,
        "policy": cell.policy,
        "seed": cell.seed,
        "num_requests": num_requests,
        "num_measured": sum(r.measured for r in step.run.records),
        "repeats": repeats,
        "num_steps": step.run.stats.num_steps,
        "leapt_share": round(fast.run.stats.num_leapt_steps / max(1, fast.run.stats.num_steps), 4),
        # Full steps run beside the kept decoders (the rest of the full steps wrote them out).
        "kept_share": round(fast.run.stats.num_kept_steps / max(1, fast.run.stats.num_steps), 4),
        "step_cpu_s": round(step_cpu, 3),
        "fast_cpu_s": round(fast_cpu, 3),
        "step_requests_per_cpu_s": round(step_rate, 1),
        "fast_requests_per_cpu_s": round(fast_rate, 1),
        "speedup": round(fast_rate / step_rate, 3),
        "max_rel_diff": comparison.max_rel_diff if math.isfinite(comparison.max_rel_diff) else None,
        "mismatches": comparison.mismatches,
    }


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "sim-speed",
        help="fast simulation vs step-by-step: requests per CPU-second and the largest difference",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--workload", default="default", help="a named workload or a trace file (default: %(default)s)"
    )
    p.add_argument(
        "--pattern",
        choices=("closed", "trace"),
        help="closed: --load clients; trace: the trace at --load times its rate "
        "(default: trace for a trace file, closed otherwise)",
    )
    p.add_argument(
        "--load", type=float, help="clients, or the trace's rate scale (default: 256 clients, or 1x)"
    )
    p.add_argument("--policy", choices=POLICIES, default="hybrid", help="(default: %(default)s)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="workload seed (default: %(default)s)")
    p.add_argument(
        "--requests",
        type=int_between(1, MAX_REQUESTS),
        default=1000,
        help=f"measured requests, at most {MAX_REQUESTS:,} (default: %(default)s)",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        help="runs of each mode, in turn; the least CPU time counts (default: %(default)s)",
    )
    p.add_argument(
        "--think-time", type=float, help="closed loop: mean think time, s (default 2; not for a trace)"
    )
    p.add_argument("--trace-rows", type=positive_int, help="trace: replay only the first N rows")
    p.add_argument(
        "--out",
        default="bench-out/sim-speed.json",
        help="JSON result file (default: %(default)s); '': write none",
    )
    p.add_argument("--json", action="store_true", help="print the JSON result instead of the table")
    p.set_defaults(func=run)


def _pattern(workload: str, asked: Pattern | None) -> Pattern:
    """A trace replays at its own timestamps (as in `bench reproduce`); the synthetic
    workloads run closed-loop clients."""
    trace = get_preset(workload).trace_file is not None
    if asked == "closed" and trace:
        raise ValueError(
            f"--pattern closed: {workload} is a trace, replayed at its own timestamps (--pattern trace)"
        )
    if asked == "trace" and not trace:
        raise ValueError(f"--pattern trace: {workload} is not a trace file")
    return asked or ("trace" if trace else "closed")


def _check_args(args: argparse.Namespace, pattern: Pattern) -> None:
    """Fill in --load's and --think-time's defaults for `pattern`, and refuse what does not
    apply to it or is out of range (ValueError, one flag a message)."""
    if args.load is None:
        args.load = 256 if pattern == "closed" else 1.0
    # Each flag said alone: the message named both, whichever was wrong.
    if not 0 < args.load < math.inf:
        raise ValueError(f"--load must be > 0 and finite, got {args.load:g}")
    if pattern == "trace" and args.think_time is not None:  # it was ignored, and not recorded
        raise ValueError(f"--think-time applies to closed-loop clients, and {args.workload} is a trace")
    if pattern == "closed" and args.think_time is None:
        args.think_time = 2.0
    if pattern == "closed" and args.load > MAX_CLIENTS:  # a billion clients ran silently for minutes
        raise ValueError(f"--load: at most {MAX_CLIENTS:,} closed-loop clients, got {args.load!r}")
    if args.think_time is not None and not 0 <= args.think_time <= MAX_THINK_TIME_S:
        # past a day a step's seconds vanish in the clock's
        raise ValueError(f"--think-time must be 0 to {MAX_THINK_TIME_S:g} s (a day), got {args.think_time:g}")
    if pattern == "closed" and args.trace_rows is not None:  # it was ignored; bench reproduce refuses it
        raise ValueError(f"--trace-rows applies to a trace, and {args.workload} runs closed-loop clients")
    if pattern == "closed" and args.load != int(args.load):
        raise ValueError(f"--load: a closed loop has a whole number of clients, got {args.load:g}")


def run(args: argparse.Namespace) -> int:
    pattern = _pattern(args.workload, args.pattern)
    _check_args(args, pattern)
    setup = BenchSetup(
        num_measured=args.requests,
        think_time_s=2.0 if args.think_time is None else args.think_time,
        max_trace_rows=args.trace_rows,
    )
    if pattern == "trace":
        rows = setup.trace_rows(args.workload)
        check_span(Path(args.workload), rows, args.load)
    make_out_folder(args.out)
    if pattern == "trace":  # once the folder is made: an error is its one line
        print(span_line(Path(args.workload), rows), file=sys.stderr)
        if cut := num_cut_to_fit(rows, setup.executor(args.workload).spec.max_model_len):
            print(f"note: {cut_note(cut, len(rows))}", file=sys.stderr)
    cell = Cell(args.workload, pattern, args.load, args.policy, args.seed)
    before = host.snapshot()  # through the module: tests replace it there
    result = measure(setup, cell, args.repeats)
    result["think_time_s"] = args.think_time  # None for a trace, replayed at its own times
    result["host"] = {"load_avg_1m_before": before.load_avg_1m}
    if result["num_measured"] < args.requests:  # the trace (or its --trace-rows) ran out first
        warm_up, measured = result["num_requests"] - result["num_measured"], result["num_measured"]
        print(
            f"note: {measured} request{'' if measured == 1 else 's'} measured of the {args.requests} asked: "
            f"the trace's rows ran out first"
            + (f" ({warm_up} more ran first as a warm-up, not measured)" if warm_up else ""),
            file=sys.stderr,
        )

    def table() -> None:
        r = result
        print(f"{cell.workload}, {pattern} {args.load:g}, {cell.policy}, seed {cell.seed}: ", end="")
        n = r["num_requests"]
        print(f"{n} {'request' if n == 1 else 'requests'} ({r['num_measured']} measured), ", end="")
        print(f"{r['num_steps']} steps: {r['leapt_share']:.1%} leapt, ", end="")
        print(f"{r['kept_share']:.1%} full beside the kept decoders, the rest full and ordinary")
        print("| mode | CPU s | requests per CPU-s |\n|---|---|---|")
        print(f"| step | {r['step_cpu_s']} | {r['step_requests_per_cpu_s']} |")
        print(f"| fast | {r['fast_cpu_s']} | {r['fast_requests_per_cpu_s']} |")
        print(f"speed-up {r['speedup']}x; max_rel_diff {r['max_rel_diff']}; mismatches {r['mismatches']}")

    emit(result, args.out, args.json, table)
    return 0 if result["mismatches"] == 0 and result["max_rel_diff"] is not None else 1
