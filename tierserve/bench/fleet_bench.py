"""`tierserve bench fleet`: a fleet of simulated replicas behind the gateway's routing, in virtual time.

Replays a request trace (default: the Azure trace in the shared data folder, as the
`azure-code` workload does) at `--rate-scale` times its rate against `--replicas` replicas
of the `default` workload's deployment (Llama-3.1-70B on 8 x A100-80GB), once per router
and scaling policy asked for, side by side. Writes results.json, report.md and plots to
`--out`. Importing this module is cheap.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tierserve.cli_args import non_negative_float, non_negative_int, out_path, positive_float, positive_int
from tierserve.workloads.trace_stream import SCALE_BY, cut_note
from tierserve.workloads.traces import span_line, span_s

TRACE_FILE = "AzureLLMInferenceTrace_code.csv"
WORKLOAD = "default"  # the deployment each replica runs
ROUTER_CHOICES = ("round-robin", "least-loaded", "prefix-affinity", "tier-aware")
SCALING_CHOICES = ("fixed", "utilization", "tier")
# Bounds on what one run may ask for: each replica is a whole engine in memory (about 10 MB,
# more with its requests), and a run of more replicas than this is a capacity plan for a
# different tool.
MAX_REPLICAS = 512


def default_trace() -> Path:
    """The Azure trace in the data folder tierserve finds ($TIERSERVE_DATA, else shared/data)."""
    from tierserve.data_dir import data_path

    return data_path(TRACE_FILE)


class FleetArgsError(ValueError):
    """Arguments that each parse but do not fit together (one line, exit status 2)."""


def _choices(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    names = list(allowed) if text == "all" else [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise FleetArgsError(f"--{what}: choose from {', '.join(allowed)} or all (got {text!r})")
    return list(dict.fromkeys(names))  # each once


def parse_kill(text: str) -> tuple[float, int]:
    """`T[@I]`: replica I (default 0) dies T virtual seconds into the run."""
    when, _, index = text.partition("@")
    try:
        at_s, replica = float(when), int(index or 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected T[@I] (seconds, replica index), got {text!r}") from None
    if not 0 <= at_s < float("inf") or replica < 0:
        raise argparse.ArgumentTypeError(f"expected T >= 0 and I >= 0, got {text!r}")
    return at_s, replica


def check_args(args: argparse.Namespace, scalings: list[str]) -> None:
    """What argparse cannot see: the fleet bounds and the kills against the fleet."""
    from tierserve.gateway.config import GatewaySettings
    from tierserve.scheduling.registry import policy_names
    from tierserve.workloads import TierMix

    # Before the trace is read: an unknown policy was found only when the first engine was
    # built, after the trace was parsed (or its error said instead) and --out was made.
    if args.policy not in policy_names():
        raise FleetArgsError(f"--policy {args.policy!r}: choose from {', '.join(policy_names())}")
    try:  # it was read when the first run began, after the trace and a progress bar
        TierMix.parse(args.tier_mix)
    except ValueError as e:
        raise FleetArgsError(f"--tier-mix: {e}") from None
    scales = scalings != ["fixed"]
    if not scales:
        _check_unused_scaling(args)
    for flag, n in (("--replicas", args.replicas), ("--max-replicas", args.max_replicas if scales else 0)):
        if n > MAX_REPLICAS:
            raise FleetArgsError(f"{flag} {n}: at most {MAX_REPLICAS} simulated replicas in one run")
    scrape_s = GatewaySettings().scrape_interval_s
    if scales and args.scale_interval_s < scrape_s:
        raise FleetArgsError(
            f"--scale-interval-s {args.scale_interval_s:g}: the autoscaler decides on the gateway's "
            f"scrapes, one every {scrape_s:g} s; decide at most that often"
        )
    if scales and args.min_replicas > args.max_replicas:
        raise FleetArgsError(f"--min-replicas {args.min_replicas} exceeds --max-replicas {args.max_replicas}")
    if scales and not args.min_replicas <= args.replicas <= args.max_replicas:
        raise FleetArgsError(
            f"--replicas {args.replicas} must lie within --min-replicas {args.min_replicas} and "
            f"--max-replicas {args.max_replicas} when autoscaling"
        )
    # A fixed fleet's replicas are known; a scaling one numbers every launch anew (replacing
    # a dead replica, scaling out again after scaling in), so any index may come to exist, and
    # the report says of a kill whose replica was never launched that it did nothing.
    for at_s, replica in args.kill if not scales else ():
        if replica >= args.replicas:
            raise FleetArgsError(
                f"--kill {at_s:g}@{replica}: the fleet never has a replica {replica} "
                f"(its replicas are numbered 0 to {args.replicas - 1})"
            )


def _scaling_defaults() -> dict[str, float]:
    """The autoscaler's flags (as argparse names them) and their defaults, the autoscaler's own."""
    from tierserve.fleet.autoscaler import AutoscaleConfig

    c = AutoscaleConfig()
    return {
        "min_replicas": c.min_replicas,
        "max_replicas": c.max_replicas,
        "startup_delay_s": c.startup_delay_s,
        "scale_interval_s": c.interval_s,
        "idle_s": c.idle_s,
    }


def _check_unused_scaling(args: argparse.Namespace) -> None:
    """A fixed fleet never scales: an autoscaler flag set for it was ignored without a word
    (and written into results.json's meta as if it had applied)."""
    for name, default in _scaling_defaults().items():
        if getattr(args, name) != default:
            flag = "--" + name.replace("_", "-")
            raise FleetArgsError(f"{flag} applies to scaling runs (--autoscale), and only a fixed fleet runs")


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "fleet",
        help="a fleet of simulated replicas behind the gateway's routing",
        description="Simulate a fleet of tierserve engine replicas (the GPU simulator) behind the "
        "gateway's own routing and flow control, in virtual time, replaying a request trace; "
        "compare routers and scaling policies side by side. Writes results.json, report.md and "
        "plots to --out: per-tier SLO attainment and goodput over time, replicas, GPU-hours "
        "(docs/fleet.md).",
    )
    p.add_argument(
        "--replicas",
        type=positive_int,
        default=4,
        help="replicas at the start (the fixed fleet's size; default: %(default)s)",
    )
    _add_trace_args(p)
    _add_scaling_args(p)
    _add_run_args(p)
    p.set_defaults(func=main)


def _add_trace_args(p: argparse.ArgumentParser) -> None:
    """What the fleet is sent: the trace, how it is scaled and how much of it."""
    p.add_argument(
        "--trace", type=Path, help=f"request trace (default: {TRACE_FILE} in $TIERSERVE_DATA or shared/data)"
    )
    p.add_argument(
        "--rate-scale",
        type=positive_float,
        default=1.0,
        help="run the trace at this many times its rate (how: --scale-by; default: %(default)s)",
    )
    p.add_argument(
        "--scale-by",
        choices=SCALE_BY,
        default="time",
        help="time: each row once, timestamps divided by the scale (its hour in minutes); copies: "
        "the trace's own span with scale times the rows, each row's extra copies at random "
        "moments before the next row's (default: %(default)s)",
    )
    p.add_argument(
        "--max-requests",
        type=positive_int,
        help="replay only the trace's first N rows (with --scale-by copies, about N x scale requests)",
    )


def _add_scaling_args(p: argparse.ArgumentParser) -> None:
    """How requests are routed, how the fleet grows and shrinks, and which replicas die."""
    defaults = _scaling_defaults()
    p.add_argument(
        "--router",
        default="tier-aware",
        help=f"{', '.join(ROUTER_CHOICES)}, a list, or all (default: %(default)s)",
    )
    p.add_argument(
        "--autoscale",
        nargs="?",
        const="all",
        default="fixed",
        help=f"scaling policies to compare ({', '.join(SCALING_CHOICES)}, a list; bare: all three)",
    )
    p.add_argument(
        "--min-replicas",
        type=positive_int,
        default=defaults["min_replicas"],
        help="autoscaling: fewest replicas (default: 1)",
    )
    p.add_argument(
        "--max-replicas",
        type=positive_int,
        default=defaults["max_replicas"],
        help="autoscaling: most replicas (default: 32)",
    )
    p.add_argument(
        "--startup-delay-s",
        type=non_negative_float,
        default=defaults["startup_delay_s"],
        help="a new replica's model load (default: Anyscale's measured 4 min 25 s for a 70B model)",
    )
    p.add_argument(
        "--scale-interval-s",
        type=positive_float,
        default=defaults["scale_interval_s"],
        help="autoscaling: seconds between decisions (default: 15)",
    )
    p.add_argument(
        "--idle-s",
        type=non_negative_float,
        default=defaults["idle_s"],
        help="calm this long before scaling in, to the size the load needs (default: %(default)s)",
    )
    p.add_argument(
        "--kill",
        action="append",
        type=parse_kill,
        default=[],
        metavar="T[@I]",
        help="replica I (0) dies at T s; repeat the flag for more: --kill 10@0 --kill 20@1",
    )


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """Each replica's deployment and engine policy, the tier draw, the simulation mode and the
    output."""
    p.add_argument(
        "--model",
        help="each replica's model: llama-3.1-70b, llama-3.1-8b, demo, or a local Hugging Face "
        "model folder (its config.json; default: llama-3.1-70b, the default workload's)",
    )
    p.add_argument("--gpu", help="each replica's GPUs: a100-80gb, h100-80gb or h200 (default: a100-80gb)")
    p.add_argument(
        "--tp",
        type=positive_int,
        help="GPUs per replica, tensor-parallel (default: 8 with the default model, else 1)",
    )
    p.add_argument(
        "--policy", default="hybrid", help="each engine's scheduling policy (default: %(default)s)"
    )
    p.add_argument(
        "--gateway-config",
        type=Path,
        metavar="FILE",
        help="a gateway config (as `tierserve gateway --config` reads it): its [gateway] flow "
        "control and routing settings for the simulated gateway; its other sections are not used "
        "(default: the gateway's defaults; docs/fleet.md lists what the simulation honours)",
    )
    p.add_argument("--tier-mix", default="5/60/30/5", help="P0/P1/P2/P3 shares (default: %(default)s)")
    p.add_argument(
        "--seed",
        type=non_negative_int,
        default=0,
        help="seed of the tiers (and copies) drawn for the trace (default: 0)",
    )
    p.add_argument(
        "--bin-s",
        type=positive_float,
        default=60.0,
        help="width of the over-time bins, s (default: %(default)s)",
    )
    p.add_argument(
        "--drain-timeout-s",
        type=positive_float,
        default=600.0,
        help="virtual s after the last arrival before what is left counts as unfinished "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--sim-mode",
        choices=("fast", "step"),
        default="fast",
        help="fast: replicas leap over runs of decode steps while nothing can reach them (the "
        "same results); step: every step (default: %(default)s)",
    )
    p.add_argument(
        "--out",
        type=lambda text: Path(out_path(text)),
        default=Path("bench-out/fleet"),
        help="results folder (default: %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="print the per-run summaries as JSON")


def main(args: argparse.Namespace) -> int:
    from tierserve.bench.output import input_warnings, make_out_dir, release_out, source_commit
    from tierserve.fleet.bench import FleetBench
    from tierserve.fleet.summary import align

    try:  # before the trace is looked for: a bad argument is said first
        routers = _choices(args.router, ROUTER_CHOICES, "router")
        scalings = _choices(args.autoscale, SCALING_CHOICES, "autoscale")
        check_args(args, scalings)
    except FleetArgsError as e:
        print(f"tierserve bench fleet: {e}", file=sys.stderr)
        return 2
    trace = args.trace or default_trace()
    commit = source_commit()  # the code that runs: a commit made during a long run is not it
    started = time.process_time()
    with input_warnings() as warned:
        bench = FleetBench(args, trace)
        make_out_dir(args.out)  # now: a bad --out must not cost the runs
        print(span_line(trace, bench.rows), file=sys.stderr)  # after: an error is its one line
        print(_replayed_line(args, bench.num_requests, bench.rows), file=sys.stderr)
        runs = [bench.run(router, scaling) for router in routers for scaling in scalings]
        _warn_if_never_scaled(args, scalings, runs)
    align(runs, bench.preset.tp, bench.autoscale_config)
    meta = {**bench.meta(commit, time.process_time() - started), "input_warnings": warned}
    from tierserve.fleet.report import write_plots, write_report

    (args.out / "results.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    plots = write_plots(args.out, runs)
    write_report(args.out / "report.md", meta, runs, plots)
    release_out(args.out)
    print(f"wrote {args.out}/results.json, report.md and {len(plots)} plots", file=sys.stderr)
    if args.json:
        print(json.dumps([{k: r[k] for k in ("router", "scaling")} | _brief(r["summary"]) for r in runs]))
    else:
        print(summary_table(runs))
        for line in _notes(meta, runs):
            print(line)
    return 0


def _notes(meta: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
    """Under the table, what report.md says of rows cut to the context and of each run's
    --kill (a new user's trial found them only there)."""
    lines = []
    if cut := meta.get("num_rows_cut_to_context"):
        lines.append(cut_note(cut, meta["num_trace_rows"]))
    from tierserve.fleet.report import faults_text

    lines += [f"faults, {r['router']} / {r['scaling']}: {said}" for r in runs if (said := faults_text(r))]
    return lines


def _warn_if_never_scaled(args: argparse.Namespace, scalings: list[str], runs: list[dict[str, Any]]) -> None:
    """A scaling fleet whose run ended before the autoscaler's first decision ran as a fixed
    one, and its row read as if it had scaled (a new user's trial: `--scale-interval-s
    100000`)."""
    scaled = [run for run in runs if run["scaling"] != "fixed"]
    end_s = max((run["summary"]["duration_s"] for run in scaled), default=math.inf)
    if end_s < args.scale_interval_s:
        import logging

        from tierserve.bench.output import TRACE_LOGGER

        logging.getLogger(TRACE_LOGGER).warning(
            "--scale-interval-s %g: the scaling runs ended by %.0f s, so their autoscalers "
            "decided only at 0 s, before any load was read, and scaled by nothing but dead "
            "replicas' replacements; give an interval shorter than the run",
            args.scale_interval_s,
            end_s,
        )


def _replayed_line(args: argparse.Namespace, num_requests: int, rows: Sequence[Any]) -> str:
    """What each run sends, beside what the trace holds at 1x (the line above): a scaled
    replay read as the trace's own rows and rate (50 rows at 1x, where 200 requests went)."""
    span = span_s(rows)
    if args.scale_by == "time":
        span /= args.rate_scale
    rate = f", {num_requests / span:.4g} requests/s" if span > 0 else ""
    how = "the trace's hours, --scale-by copies" if args.scale_by == "copies" else "--scale-by time"
    return (
        f"replayed at --rate-scale {args.rate_scale:g} ({how}): {num_requests:,} requests "
        f"over {span:,.6g} s{rate}, per run"
    )


def summary_table(runs: list[dict[str, Any]]) -> str:
    """One line a run: its SLO attainment by tier, goodput, GPU-hours and the requests it did
    not serve (report.md has the rest)."""
    from tierserve.fleet.report import rate_text

    head = ["run", "P0", "P1", "P2", "P3", "goodput req/s", "GPU-h", "to last arrival", "to last end"]
    head += ["launched", "refused", "lost", "other"]
    rows = [head]
    for run in runs:
        s = run["summary"]
        tiers = s["tiers"]
        goodput = [t["goodput_rps"] for t in tiers.values()]
        rows.append(
            [
                f"{run['router']} / {run['scaling']}",
                *(_share(tiers[name]["slo_attainment"]) for name in ("P0", "P1", "P2", "P3")),
                "-" if None in goodput else rate_text(sum(goodput)),  # a sparse trace's 0.0417, not 0.042
                rate_text(s["gpu_hours"]),
                rate_text(s.get("gpu_hours_arrivals")),
                rate_text(s["gpu_hours_common"]),
                str(s["num_replicas_launched"]),
                str(sum(t["num_refused"] for t in tiers.values())),
                str(s["num_lost"]),
                # shed or rejected by an engine, or unfinished at the end: none left out unseen
                str(
                    sum(t[k] for t in tiers.values() for k in ("num_shed", "num_rejected", "num_unfinished"))
                ),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    if runs:
        first = runs[0]["summary"]
        lines.append(
            "GPU-h: to each run's own end; to last arrival: from the start to "
            f"{first['last_arrival_s']:,.0f} s, the same window for every run; to last end: every "
            f"fleet counted on to {first['common_end_s']:,.0f} s, the latest end among these runs "
            "(report.md says more)"
        )
    return "\n".join(lines)


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _brief(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k not in ("over_time", "replicas_over_time")}
