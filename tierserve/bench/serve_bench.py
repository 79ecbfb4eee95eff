"""`tierserve bench serve`: HTTP load against `serve --backend sim`, started by this process.

A seeded, bounded, closed-loop load generator (aiohttp, loopback only): `--concurrency`
clients stream `--requests` completions with tiers drawn from `--tier-mix`. The server is
the real app (admission, rate limits, SSE) over the simulated deployment, so requests take
the time the simulator predicts. As `tierserve serve` does, the HTTP server runs in this
process and the engine in a process of its own. Reports per-tier TTFT P50/P95, rejections by reason and
throughput, and the latency the API layer adds to the first token: HTTP TTFT minus the
in-process TTFT (arrival -> return of the `Engine.step()` that produced the first token:
what a caller of the engine sees, where the engine runs).

With `--flood-clients N` (default 3) the same requests run a second time, against a fresh
server, while N clients post ~1 MiB JSON bodies (valid and invalid; flood.py); the two
runs are reported side by side with the targets: API overhead P99 < 2 ms, P0 TTFT P95
within 10 % of the run without the flood.

The TTFT and overhead percentiles leave out the first `--warmup` requests sent (default:
one per client, capped at a third of the requests): every client sends its first request
at once, a start-up burst no steady load has (up to 200 first tokens in a few steps).
Counts and throughput cover every request, and `api_overhead_all_*` is the overhead over
every request.

That added latency is measured twice. `api_overhead_*`: on the server, from the request
reaching the app to the first token's chunk handed to the socket, minus the in-process TTFT,
split into the request path (parse, tokenize, limits, admission) and the response path
(engine process -> pipe -> event loop -> detokenize -> SSE). `client_overhead_*`: as the
clients see it, so it also holds the loopback network and the load generator's own time
(on a small machine much of it is the client). The load generator
runs in a child process so that its CPU does not queue behind the server's for the
interpreter lock, and, on Linux with two CPUs or more, on a CPU of its own: the server
process keeps off it for the run. Sharing a core, the generator's work on each response
(parsing headers, SSE lines) preempts the server thread that has just written them, and
the server-side figures would measure the client. Importing this module is cheap.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from tierserve.bench.flood import FloodReport
from tierserve.bench.host import HostMonitor, read_cpu_times, steal_pct
from tierserve.bench.output import emit, make_out_folder, source_commit
from tierserve.cli_args import non_negative_int, positive_float, positive_int
from tierserve.scheduling.registry import DEFAULT_POLICY, policy_names
from tierserve.server.loadgen import CUT_OFF, TIERS, Outcome, Spec, drive_in_child, make_specs
from tierserve.workloads.spec import TierMix

if TYPE_CHECKING:
    from tierserve.server.config import ServeConfig

DESCRIPTION = """\
Load-test the real HTTP server, started in this process over a simulated GPU deployment
(by default Llama-3.1-70B on 8 x A100-80GB), and measure what the API layer adds.

--concurrency clients stream --requests completions over loopback, with tiers drawn from
--tier-mix. Because the deployment is simulated, each request takes the time the GPUs
would take, and the run needs no GPU. The report gives, per tier, TTFT P50/P95 over HTTP
and inside the engine, refusals by reason, throughput, and the API overhead: the HTTP
time to first token minus the engine's own, on the server (split into the request and
the response path) and as the clients see it. The first --warmup requests (the burst when
every client starts at once) are left out of the percentiles.

The load generator runs in a child process, on a CPU of its own where there are two or
more. On a busy host the overhead figures rise; the report says when the host was busy.
The JSON result goes to --out."""


@dataclass
class BenchResult:
    config: dict[str, Any]
    wall_s: float
    num_sent: int
    num_ok: int
    rejections: dict[str, int]  # answers with an error status, by status and reason
    num_cut_off: int  # requests still running when --duration-s ran out (not refusals)
    throughput_rps: float
    output_tokens_per_s: float
    tiers: dict[str, dict[str, float | int | None]] = field(default_factory=dict)
    warmup_requests: int = 0  # the first requests sent, left out of the TTFT and overhead percentiles
    api_overhead_p50_ms: float | None = None  # server-side: HTTP TTFT - in-process TTFT
    api_overhead_p99_ms: float | None = None
    api_overhead_samples: int = 0
    api_overhead_all_p50_ms: float | None = None  # the same over every request, start-up burst included
    api_overhead_all_p99_ms: float | None = None
    request_path_p50_ms: float | None = None  # request reached the app -> engine arrival
    request_path_p99_ms: float | None = None
    response_path_p50_ms: float | None = None  # the step returned -> the first chunk sent
    response_path_p99_ms: float | None = None
    client_overhead_p50_ms: float | None = None  # client-side TTFT - in-process TTFT
    client_overhead_p99_ms: float | None = None
    # Share of the server CPUs' time that the hypervisor gave to other machines during the run
    # (Linux `steal`): on a shared host, the stalls behind a bad P99 may not be the server's.
    server_cpu_steal_pct: float | None = None
    flood: FloodReport | None = None  # the flood of large bodies sent during this run, if any
    with_flood: BenchResult | None = None  # the same requests again, beside a flood
    host: dict[str, Any] | None = None  # how busy the whole host was (tierserve.bench.host.HostLoad)
    host_warning: str | None = None  # one line naming the host's load when it is high


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=1000, method="inclusive")[round(q * 1000) - 1]


def _tier_summary(
    mine: list[Outcome], engine_trace: dict[str, tuple[float, float]], steady: Callable[[int], bool]
) -> dict[str, Any]:
    """One tier's row: what was sent, refused and cut off, and TTFT percentiles over the steady
    requests answered (the HTTP and in-process columns over the same requests)."""
    timed = [o for o in mine if steady(o.index) and o.status == "ok" and o.ttft_s is not None]
    ttfts = [o.ttft_s * 1000 for o in timed if o.ttft_s is not None]
    inside = [engine_trace[o.request_id][0] * 1000 for o in timed if o.request_id in engine_trace]
    # What the server (and the client's hop) added to each request's engine TTFT, per request.
    added = [
        (o.ttft_s - engine_trace[o.request_id][0]) * 1000
        for o in timed
        if o.ttft_s is not None and o.request_id in engine_trace
    ]
    return {
        "sent": len(mine),
        "ok": sum(o.status == "ok" for o in mine),
        "rejected": sum(o.status not in ("ok", CUT_OFF) for o in mine),  # answered with an error
        "cut_off": sum(o.status == CUT_OFF for o in mine),  # still running when --duration-s ran out
        "ttft_samples": len(ttfts),  # what the percentiles are over: ok, and not in the start-up burst
        "ttft_p50_ms": _pct(ttfts, 0.50),
        "ttft_p95_ms": _pct(ttfts, 0.95),
        "engine_ttft_p50_ms": _pct(inside, 0.50),
        "engine_ttft_p95_ms": _pct(inside, 0.95),
        "added_p95_ms": _pct(added, 0.95),
        "added_samples": len(added),
    }


def _overhead_split(
    engine_trace: dict[str, tuple[float, float]],
    http_trace: dict[str, tuple[float, float | None]],
    steady: Callable[[str], bool],
) -> tuple[list[float], list[float], list[float]]:
    """Per request traced on both sides, in ms: the request path (app -> engine arrival) and
    the response path (step returned -> chunk sent) of the steady requests, and their sum
    for every request (start-up burst included)."""
    request, response, everything = [], [], []
    for rid, (ttft, returned_at) in engine_trace.items():
        received_at, sent_at = http_trace.get(rid, (None, None))
        if received_at is None or sent_at is None:
            continue
        before, after = (returned_at - ttft - received_at) * 1000, (sent_at - returned_at) * 1000
        everything.append(before + after)
        if steady(rid):
            request.append(before)
            response.append(after)
    return request, response, everything


def summarize(
    outcomes: list[Outcome],
    engine_trace: dict[str, tuple[float, float]],
    http_trace: dict[str, tuple[float, float | None]],
    wall_s: float,
    config: dict[str, Any],
    warmup: int = 0,
) -> BenchResult:
    """`engine_trace`: id -> (in-process TTFT, `time.monotonic()` when the step that produced
    the first token returned); `http_trace`: id -> (request reached the app at, first chunk
    sent at)."""
    ok = [o for o in outcomes if o.status == "ok"]
    result = BenchResult(
        config=config,
        wall_s=wall_s,
        num_sent=len(outcomes),
        num_ok=len(ok),
        rejections=dict(Counter(o.status for o in outcomes if o.status not in ("ok", CUT_OFF))),
        num_cut_off=sum(o.status == CUT_OFF for o in outcomes),
        throughput_rps=len(ok) / wall_s if wall_s else 0.0,
        output_tokens_per_s=sum(o.num_output_tokens for o in ok) / wall_s if wall_s else 0.0,
        warmup_requests=warmup,
    )

    def steady(index: int) -> bool:
        return not 0 <= index < warmup  # -1: not known to be one of the start-up burst

    for tier in TIERS:
        result.tiers[tier] = _tier_summary([o for o in outcomes if o.tier == tier], engine_trace, steady)
    # The overhead's steady requests are the timed ones: answered, past the start-up burst.
    index_of = {o.request_id: o.index for o in ok if o.ttft_s is not None}
    request, response, everything = _overhead_split(
        engine_trace, http_trace, lambda rid: rid in index_of and steady(index_of[rid])
    )
    overhead = [a + b for a, b in zip(request, response, strict=True)]
    client = [
        (o.ttft_s - engine_trace[o.request_id][0]) * 1000
        for o in ok
        if o.ttft_s is not None and o.request_id in engine_trace and steady(o.index)
    ]
    result.api_overhead_p50_ms, result.api_overhead_p99_ms = _pct(overhead, 0.50), _pct(overhead, 0.99)
    result.api_overhead_all_p50_ms = _pct(everything, 0.50)
    result.api_overhead_all_p99_ms = _pct(everything, 0.99)
    result.request_path_p50_ms, result.request_path_p99_ms = _pct(request, 0.50), _pct(request, 0.99)
    result.response_path_p50_ms, result.response_path_p99_ms = _pct(response, 0.50), _pct(response, 0.99)
    result.client_overhead_p50_ms, result.client_overhead_p99_ms = _pct(client, 0.50), _pct(client, 0.99)
    result.api_overhead_samples = len(overhead)
    return result


@contextmanager
def _cpu_for_the_load_generator() -> Iterator[set[int] | None]:
    """Keep this process (and the threads it starts inside the block) off one CPU, and
    yield that CPU for the load generator; None where affinity cannot be set."""
    get = getattr(os, "sched_getaffinity", None)
    cpus: set[int] = get(0) if get is not None else set()
    if len(cpus) < 2:
        yield None
        return
    spare = max(cpus)
    os.sched_setaffinity(0, cpus - {spare})
    try:
        yield {spare}
    finally:
        os.sched_setaffinity(0, cpus)


def api_key(env: str | None) -> str | None:
    """The key in environment variable `env` (None: send none); ValueError, said as
    --api-key-env's, where it is unset or empty."""
    if env is None:
        return None
    key = os.environ.get(env, "")
    if not key:
        raise ValueError(f"--api-key-env {env}: that environment variable is unset or empty")
    return key


def checked_config(args: argparse.Namespace) -> ServeConfig:
    """The servers' config, once every setting they would refuse is checked, before --out's
    folder is made or a server starts: an unset --api-key-env (or none where --config needs
    keys), a bad --config, and a --model, --gpu or --tp the sim backend cannot build
    (building it is cheap: it loads no weights)."""
    from tierserve.server.backends import BackendError, build_backend
    from tierserve.server.config import load_serve_config

    api_key(args.api_key_env)
    config = load_serve_config(args.config)
    if config.requires_key and args.api_key_env is None:  # else every request is a 401
        raise ValueError(
            f"--config {args.config}: its tenants need an API key; name the environment variable "
            "that holds one with --api-key-env NAME"
        )
    context = build_backend("sim", args.model, gpu=args.gpu, tp=args.tp).executor.spec.max_model_len
    (_, prompt_max), (_, output_max) = args.prompt_tokens, args.max_tokens
    if prompt_max + output_max > context:  # else every such request is a 400
        raise BackendError(
            f"--prompt-tokens HI + --max-tokens HI is {prompt_max} + {output_max} = "
            f"{prompt_max + output_max} tokens, more than {args.model}'s context of {context}"
        )
    return config


def run_bench(args: argparse.Namespace, config: ServeConfig) -> BenchResult:
    """One run without the flood of large bodies and, with `--flood-clients`, one with it,
    each against a fresh server (its engine in a process of its own) and the same requests;
    `config` is `checked_config(args)`."""
    mix = [float(x) for x in args.tier_mix.split("/")]
    specs = make_specs(args.requests, args.seed, mix, tuple(args.prompt_tokens), tuple(args.max_tokens))
    runs = 2 if args.flood_clients else 1
    _say(f"run 1 of {runs}: {args.requests} requests, at most {args.duration_s:g} s, alone")
    result = _run_once(args, specs, config, flood_clients=0)
    if args.flood_clients:
        _say(
            f"run 2 of 2: the same requests beside {args.flood_clients} clients posting ~1 MiB "
            f"bodies, at most {args.duration_s:g} s"
        )
        result.with_flood = _run_once(args, specs, config, flood_clients=args.flood_clients)
    return result


def _say(what: str) -> None:
    """A line on stderr as each run starts: a run takes minutes, and the terminal was blank."""
    print(f"[bench serve] {what} ...", file=sys.stderr, flush=True)


def _run_once(
    args: argparse.Namespace, specs: list[Spec], config: ServeConfig, flood_clients: int
) -> BenchResult:
    from tierserve.bench.flood import Flood
    from tierserve.server.backends import BackendSpec
    from tierserve.server.embedded import embedded_server
    from tierserve.server.state import spawn_state
    from tierserve.server.tracing import ServeTrace

    engine_trace: dict[str, tuple[float, float]] = {}
    flood_report = None
    # The server and its engine process start inside this block, so they inherit its CPUs.
    with _cpu_for_the_load_generator() as client_cpus:
        backend = BackendSpec("sim", args.model, args.gpu, args.tp)
        state = spawn_state(config, backend, policy=args.policy, log_level="WARNING")
        state.engine.ttft_trace = engine_trace
        state.trace = ServeTrace()
        with embedded_server(state, freeze_heap=True) as srv:
            flood = Flood(srv.url, state.model.name, flood_clients, args.duration_s + 60, client_cpus)
            if flood_clients:
                flood.start()
            server_cpus = _server_cpus(client_cpus)
            monitor = HostMonitor()
            times_before = read_cpu_times()
            start = time.perf_counter()
            try:
                outcomes = drive_in_child(
                    srv.url,
                    state.model.name,
                    specs,
                    args.concurrency,
                    args.duration_s,
                    client_cpus,
                    api_key(args.api_key_env),
                )
            finally:
                wall = time.perf_counter() - start
                times_after = read_cpu_times()
                host = monitor.finish()
                if flood_clients:
                    flood_report = flood.stop()
    http_trace = {rid: (r.received_at, r.first_sent_at) for rid, r in state.trace.records.items()}
    settings = {k: v for k, v in vars(args).items() if k not in ("func", "json", "out")}
    warmup = args.warmup if args.warmup is not None else min(args.concurrency, args.requests // 3)
    result = summarize(outcomes, engine_trace, http_trace, wall, settings, warmup)
    result.flood = flood_report
    result.host = host.as_dict()
    result.host_warning = host.warning()
    if times_before is not None and times_after is not None and server_cpus:
        result.server_cpu_steal_pct = steal_pct(times_before, times_after, server_cpus)
    return result


def _server_cpus(client_cpus: set[int] | None) -> set[int]:
    """The CPUs this process may run on now (inside the block that keeps it off the load
    generator's); empty where the platform does not say."""
    get = getattr(os, "sched_getaffinity", None)
    return set(get(0)) - (client_cpus or set()) if get is not None else set()


def _ms(v: float | int | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _print_all(r: BenchResult) -> None:
    print_table(r)
    if r.with_flood is not None:
        print("\nthe same requests, with the flood:")
        print_table(r.with_flood)
        print_flood_comparison(r, r.with_flood)


def print_table(r: BenchResult) -> None:
    c = r.config
    print(
        f"bench serve: {c['model']} on {c['tp']} x {c['gpu']} (sim), policy {c['policy']}, "
        f"{c['concurrency']} concurrent streams, {r.num_sent} requests in {r.wall_s:.1f} s"
    )
    print(
        f"{'tier':<5}{'sent':>6}{'ok':>6}{'refused':>8}{'timed':>7}{'TTFT P50 ms':>13}{'TTFT P95 ms':>13}"
        f"{'engine P50 ms':>15}{'engine P95 ms':>15}"
    )
    for tier, t in r.tiers.items():
        print(
            f"{tier:<5}{t['sent']:>6}{t['ok']:>6}{t['rejected']:>8}{t['ttft_samples']:>7}"
            f"{_ms(t['ttft_p50_ms']):>13}"
            f"{_ms(t['ttft_p95_ms']):>13}{_ms(t['engine_ttft_p50_ms']):>15}{_ms(t['engine_ttft_p95_ms']):>15}"
        )
    print(f"throughput: {r.throughput_rps:.2f} req/s, {r.output_tokens_per_s:.0f} output tokens/s")
    if r.num_sent < c.get("requests", 0):
        print(f"{c['requests'] - r.num_sent} of the {c['requests']} requests not sent: --duration-s ran out")
    if r.num_cut_off:
        print(f"{r.num_cut_off} requests still running when --duration-s ran out (cut off, not refused)")
    print(
        "TTFT and overhead percentiles are over the 'timed' requests: those answered, less the "
        f"first {r.warmup_requests} sent (the start-up burst)"
    )
    if 0 < r.api_overhead_samples < 100:
        print(
            f"(a P99 over {r.api_overhead_samples} requests is about their slowest: send more "
            "--requests for a P99 that means more)"
        )
    print(f"rejections: {r.rejections or 'none'}")
    print(
        f"API overhead on the server (HTTP TTFT - in-process TTFT, {r.api_overhead_samples} requests): "
        f"P50 {_ms(r.api_overhead_p50_ms)} ms, P99 {_ms(r.api_overhead_p99_ms)} ms "
        f"(with the start-up burst: P50 {_ms(r.api_overhead_all_p50_ms)} ms, "
        f"P99 {_ms(r.api_overhead_all_p99_ms)} ms)"
    )
    print(
        f"  request path (app -> engine arrival): P50 {_ms(r.request_path_p50_ms)} ms, "
        f"P99 {_ms(r.request_path_p99_ms)} ms; response path (step returned -> chunk sent): "
        f"P50 {_ms(r.response_path_p50_ms)} ms, P99 {_ms(r.response_path_p99_ms)} ms"
    )
    print(
        f"as the clients see it (with loopback and the load generator's own time): "
        f"P50 {_ms(r.client_overhead_p50_ms)} ms, P99 {_ms(r.client_overhead_p99_ms)} ms"
    )
    if r.server_cpu_steal_pct is not None:
        print(
            f"host: {r.server_cpu_steal_pct:.2f} % of the server CPU's time went to other machines "
            "(steal); on a shared host, some stalls behind the P99 may be those"
        )
    if r.host_warning:
        print(r.host_warning)


def print_flood_comparison(quiet: BenchResult, flooded: BenchResult) -> None:
    """The run without the flood beside the run with it."""
    f = flooded.flood
    sent = "-" if f is None else f"{f.num_sent} bodies sent, answers {f.statuses or 'none'}"
    clients = 0 if f is None else f.clients
    print(f"\nbeside a flood of ~1 MiB JSON bodies from {clients} clients ({sent}):")
    print(f"{'':<34}{'without flood':>16}{'with flood':>16}")

    def row(label: str, a: float | int | None, b: float | int | None, unit: str = " ms") -> None:
        print(f"{label:<34}{_ms(a) + unit:>16}{_ms(b) + unit:>16}")

    row("API overhead P50", quiet.api_overhead_p50_ms, flooded.api_overhead_p50_ms)
    row("API overhead P99", quiet.api_overhead_p99_ms, flooded.api_overhead_p99_ms)
    for tier in quiet.tiers:
        row(f"{tier} TTFT P50 (client)", quiet.tiers[tier]["ttft_p50_ms"], flooded.tiers[tier]["ttft_p50_ms"])
        row(f"{tier} TTFT P95 (client)", quiet.tiers[tier]["ttft_p95_ms"], flooded.tiers[tier]["ttft_p95_ms"])
    print(f"{'refused':<34}{sum(quiet.rejections.values()):>16}{sum(flooded.rejections.values()):>16}")
    if (judged := flood_p0_change(quiet, flooded)) is not None:
        change, added, samples = judged
        verdict = "within" if added <= 10.0 else "NOT within"
        few = " (a P95 over so few is their largest few)" if samples < 100 else ""
        print(
            f"P0 TTFT P95 with the flood: {change:+.1f} %; the P95 of what the server added to each "
            f"request's engine TTFT moved by {added:+.1f} % of P0's TTFT P95 without the flood ({verdict} "
            "the 10 % target; "
            f"{samples} P0 requests a run{few})"
        )
    for name, r in (("without", quiet), ("with", flooded)):
        p99 = r.api_overhead_p99_ms
        if p99 is not None:
            print(
                f"API overhead P99 {name} the flood: {p99:.2f} ms "
                f"({'under' if p99 < 2.0 else 'NOT under'} the 2 ms target)"
            )


def flood_p0_change(quiet: BenchResult, flooded: BenchResult) -> tuple[float, float, int] | None:
    """P0's TTFT P95 beside the flood against without it, in % of the P95 without: the whole
    change, and the change in the P95 of what the server added to each P0 request's engine
    TTFT (its client TTFT less its engine TTFT, request by request), and the fewer P0
    requests those are over. The runs' P0 requests land in different simulated steps, so
    the whole change moved -13 to +18 % between identical runs: the server's part is what
    the flood can touch. None where either run lacks a figure."""
    a, b = quiet.tiers["P0"], flooded.tiers["P0"]
    figures = (a["ttft_p95_ms"], b["ttft_p95_ms"], a.get("added_p95_ms"), b.get("added_p95_ms"))
    if any(x is None for x in figures) or not figures[0]:
        return None
    http_a, http_b, added_a, added_b = (float(x) for x in figures)  # type: ignore[arg-type]
    change = 100.0 * (http_b - http_a) / http_a
    added = 100.0 * (added_b - added_a) / http_a
    return change, added, int(min(a.get("added_samples") or 0, b.get("added_samples") or 0))


def _range(text: str) -> tuple[int, int]:
    lo, dash, hi = text.partition("-")
    if dash and not hi:  # "5-" is not 5-5: a bound left out by mistake
        raise argparse.ArgumentTypeError(f"expected LO-HI or N, got {text!r}")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:  # argparse said "invalid _range value", naming this function
        raise argparse.ArgumentTypeError(f"expected LO-HI or N, got {text!r}") from None
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"expected LO-HI with 1 <= LO <= HI, got {text!r}")
    return a, b


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "serve",
        help="HTTP load against the API server on the sim backend",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--requests", type=int, default=600, help="requests to send (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=200, help="concurrent streams (default: %(default)s)")
    p.add_argument(
        "--duration-s", type=positive_float, default=120.0, help="stop sending after this long (default: 120)"
    )
    p.add_argument(
        "--seed",
        type=non_negative_int,
        default=0,
        help="seed of the requests' tiers and lengths (default: 0)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        help="first requests sent left out of the TTFT and overhead percentiles (default: the concurrency, "
        "at most a third of the requests)",
    )
    p.add_argument("--tier-mix", default="5/60/30/5", help="P0/P1/P2/P3 shares (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=_range, default=(64, 1024), help="LO-HI (default: 64-1024)")
    p.add_argument("--max-tokens", type=_range, default=(16, 128), help="LO-HI (default: 16-128)")
    p.add_argument(
        "--flood-clients",
        type=int,
        default=3,
        help="clients sending ~1 MiB JSON bodies (valid and invalid) during a second run of the same "
        "requests, reported beside the first; 0: no second run (default: %(default)s)",
    )
    p.add_argument("--model", default="llama-3.1-70b", help="simulated model (default: %(default)s)")
    p.add_argument("--gpu", default="a100-80gb", help="simulated GPU (default: %(default)s)")
    p.add_argument("--tp", type=positive_int, default=8, help="simulated tensor-parallel GPUs (default: 8)")
    p.add_argument(
        "--policy",
        choices=policy_names(),
        default=DEFAULT_POLICY,
        help="scheduling policy (default: %(default)s)",
    )
    p.add_argument("--config", help="server/engine config TOML (default: open server, default tiers)")
    p.add_argument(
        "--api-key-env",
        metavar="NAME",
        help="environment variable holding the API key the clients send (for a --config whose "
        "tenants need keys; the key is not written to the results; the flood sends none)",
    )
    p.add_argument(
        "--out",
        default="bench-out/serve-bench.json",
        help="JSON result file (default: %(default)s); '': write none",
    )
    p.add_argument("--json", action="store_true", help="print the JSON result instead of the table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for wrong, message in (
        (not 1 <= args.requests <= 100_000, f"need 1 <= --requests <= 100000, got {args.requests}"),
        (not 1 <= args.concurrency <= 2000, f"need 1 <= --concurrency <= 2000, got {args.concurrency}"),
        # The load generator waits on sockets for --duration-s and a margin, in whole ms.
        (
            not 0 < args.duration_s <= 86_400,
            f"need 0 < --duration-s <= 86400 (a day), got {args.duration_s:g}",
        ),
        (not args.model.strip(), f"--model: expected a model name or a model directory, got {args.model!r}"),
        (not args.gpu.strip(), f"--gpu: expected a GPU name, got {args.gpu!r}"),
    ):
        if wrong:
            print(f"tierserve bench serve: {message}", file=sys.stderr)
            return 2
    if not 0 <= args.flood_clients <= 16:
        print("tierserve bench serve: need 0 <= --flood-clients <= 16", file=sys.stderr)
        return 2
    if args.warmup is not None and not 0 <= args.warmup < args.requests:
        print("tierserve bench serve: need 0 <= --warmup < --requests", file=sys.stderr)
        return 2
    try:  # the check `bench reproduce` and `bench fleet` make
        TierMix.parse(args.tier_mix)
    except ValueError as e:
        print(f"tierserve bench serve: --tier-mix: {e}", file=sys.stderr)
        return 2
    config = checked_config(args)
    make_out_folder(args.out)
    commit = source_commit()  # the code that runs (a commit made during the run is not it)
    result = run_bench(args, config)
    out = {**asdict(result), "commit": commit}
    if result.with_flood is not None and (judged := flood_p0_change(result, result.with_flood)):
        change, added, samples = judged
        out["flood_p0"] = {
            "ttft_p95_change_pct": change,
            "server_added_change_pct": added,
            "samples": samples,
        }
    emit(out, args.out, args.json, lambda: _print_all(result))
    return 0
