"""`tierserve bench gateway`: what the gateway adds, and what its flow control buys.

Local replicas (`serve --backend sim`, in their own processes) and gateways in front of
them, loopback only, bounded in requests and time:

1. Overhead: `--streams` clients, each sending its next stream as its last ends, to one
   replica directly for half the time, then through a gateway with that replica alone,
   then directly again for the other half (what drifts with time falls on both sides). Two measures of what
   the gateway adds to the first token: the difference of the two runs' TTFT P50s and P99s
   (client side: it holds the extra hop, but also the replica's step timing, which moves
   each run's TTFTs by up to a step), and the gateway's own share of each stream's first
   bytes from its `tierserve_gateway_added_seconds` histogram (per request, exact to its
   buckets).
2. Overload: replicas capped at `--max-seqs` running requests; their capacity is probed
   (closed loop), then an open-loop, seeded Poisson load at `--load` x that capacity with a
   tier mix runs for `--duration` seconds against a gateway with flow control (upstreams
   saturate at one waiting request, requests queue in the gateway by tier) and one
   without (never saturated: plain least-loaded). Per tier: SLO attainment (first token
   within the tier's TTFT target, over requests sent) and goodput (such requests per s).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from tierserve.bench.host import HostMonitor
from tierserve.cli_args import non_negative_int, positive_float, positive_int
from tierserve.scheduling import POLICIES
from tierserve.tiers import Tier

MODEL = "llama-3.1-70b"
TIER_MIX = {Tier.P0: 0.2, Tier.P1: 0.3, Tier.P2: 0.5}
# The most a stream may stay silent, headers included: longer than a request may wait in the
# gateway's queue (P3: 120 s), which sends the client nothing meanwhile.
REQUEST_TIMEOUT_S = 150.0
OVERHEAD_WARMUP_S = 3.0
# The closed-loop probe of the fleet's capacity: long enough for many requests to complete
# (3 s gave 0.63 requests/s for two replicas, and an overload arm of 7 requests).
CAPACITY_PROBE_MIN_S, CAPACITY_PROBE_MAX_S = 3.0, 10.0
MIN_OFFERED_RPS = 0.5  # the open loop's least rate, whatever --load x capacity is
# A stream may take this long in all. A 30 s cap on the whole stream made a request whose
# first token met its target a miss once its answer took longer (P2's 60 s target could
# never be met).
STREAM_LIMIT_S = 600.0
MAX_OPEN_LOOP_REQUESTS = 50_000  # one arm's requests: --load x capacity x --duration
PROMPT_TOKENS_MARGIN = 64  # the requests' short chat prompts, with the template's tokens


@dataclass(frozen=True, slots=True)
class Shot:
    tier: Tier
    ok: bool
    ttft_s: float | None
    status: str = "ok"  # else why not: the HTTP status, "incomplete" stream, or "http_error:<exception>"


def _duration(text: str) -> float:
    """--duration: at least a second (a request is sent at once, so a shorter one gave a
    goodput of 10^9 requests/s)."""
    value = positive_float(text)
    if value < 1.0:
        raise argparse.ArgumentTypeError(f"expected at least 1 (seconds), got {value:g}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "gateway",
        help="the gateway's added latency and its flow control under overload",
        description="Start simulated tierserve replicas and the gateway on loopback, then measure "
        "(1) the gateway's own share of each stream's time to first token at --streams concurrent "
        "streams, and (2) per-tier SLO attainment with the gateway's tier-aware flow control "
        "against plain least-loaded routing at --load times the replicas' capacity "
        "(docs/gateway.md).",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument(
        "--streams", type=positive_int, default=200, help="concurrent streams for the overhead (default 200)"
    )
    p.add_argument(
        "--overhead-seconds",
        type=positive_float,
        default=15.0,
        help="seconds each overhead arm is measured, the direct one in two halves around the "
        "gateway's, each part after a 3 s warm-up (default 15)",
    )
    p.add_argument(
        "--overhead-tokens",
        type=positive_int,
        default=64,
        help="output tokens per overhead request (default 64)",
    )
    p.add_argument("--replicas", type=positive_int, default=2, help="local replicas (default 2)")
    p.add_argument(
        "--max-seqs", type=positive_int, default=4, help="running requests per replica in the overload run"
    )
    p.add_argument(
        "--load", type=positive_float, default=1.2, help="offered load, x the probed capacity (default 1.2)"
    )
    p.add_argument(
        "--duration",
        type=_duration,
        default=30.0,
        help="seconds of open-loop load per arm, at least 1 (default 30)",
    )
    p.add_argument(
        "--upstream-policy",
        default="fcfs",
        choices=sorted(POLICIES),
        help="the overload replicas' own scheduling: fcfs (close to vLLM's default, no tiers; the "
        "default) shows what the gateway's tiers buy; hybrid, tierserve's engines",
    )
    p.add_argument(
        "--max-tokens", type=positive_int, default=32, help="output tokens per request (default 32)"
    )
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the request mix (default: 0)")
    p.set_defaults(func=run)


def _session(max_connections: int) -> Any:
    """The load's client. aiohttp: httpx took 13-24 ms of CPU per stream at 200 streams on
    this 2-core host, enough to make the client the bottleneck it measures."""
    import aiohttp

    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max_connections),
        timeout=aiohttp.ClientTimeout(total=STREAM_LIMIT_S, sock_read=REQUEST_TIMEOUT_S),
    )


async def _shot(session: Any, url: str, tier: Tier, max_tokens: int, i: int) -> Shot:
    import aiohttp

    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"request {i}: tell me something"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    start = time.perf_counter()
    ttft = None
    try:
        async with session.post(
            url + "/v1/chat/completions", json=body, headers={"x-request-tier": tier.name}
        ) as r:
            if r.status != 200:
                await r.read()
                return Shot(tier, False, None, str(r.status))
            tail = b""
            async for chunk in r.content.iter_any():
                if ttft is None and b'"content": "' in chunk.replace(b'"content": ""', b""):
                    ttft = time.perf_counter() - start
                tail = (tail + chunk)[-64:]
            ok = b"[DONE]" in tail and b'"error"' not in tail
            return Shot(tier, ok, ttft, "ok" if ok else "incomplete")
    except (aiohttp.ClientError, TimeoutError) as e:
        return Shot(tier, False, ttft, f"http_error:{type(e).__name__}")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _streams(
    url: str, streams: int, seconds: float, max_tokens: int, seed: int, first_id: int = 0
) -> list[float]:
    """TTFTs (ms) of the requests `streams` clients send back to back for `seconds` (each
    sends its next as its last ends), leaving out the first OVERHEAD_WARMUP_S. Starts spread
    over the first second and lengths drawn from half to 1.5x `max_tokens` keep the streams
    out of step (equal ones would start and end in waves)."""
    rng = random.Random(seed)
    ttfts: list[float] = []
    answers: Counter[str] = Counter()
    async with _session(streams + 8) as session:
        await _shot(session, url, Tier.P1, 1, -1)  # open a connection and the route
        start = time.perf_counter()
        stop = start + OVERHEAD_WARMUP_S + seconds

        async def client(k: int, delay: float) -> None:
            await asyncio.sleep(delay)
            i = 0
            while time.perf_counter() < stop:
                sent = time.perf_counter()
                tokens = rng.randint(max(1, max_tokens // 2), max(1, 3 * max_tokens // 2))
                shot = await _shot(session, url, Tier.P1, tokens, first_id + k * 100_000 + i)
                if shot.ok and shot.ttft_s is not None and sent >= start + OVERHEAD_WARMUP_S:
                    ttfts.append(shot.ttft_s * 1000)
                answers[shot.status] += 1
                i += 1

        await asyncio.gather(*(client(k, rng.random()) for k in range(streams)))
    if not ttfts and answers.total() and "ok" not in answers:
        raise RuntimeError(
            f"every request of the overhead run failed ({_answers(answers)}); "
            "a 400 may mean --overhead-tokens is past the model's context"
        )
    return ttfts


async def _metrics(url: str) -> str:
    async with _session(2) as session, session.get(url + "/metrics") as r:
        return str(await r.text())


async def _overhead(
    direct: str, gateway: str, streams: int, seconds: float, max_tokens: int, seed: int
) -> dict[str, float]:
    out: dict[str, list[float]] = {"direct": [], "gateway": []}
    # Direct, through the gateway, direct again (seeds apart): whatever drifts with time —
    # the replica warming up, its prefix cache filling — falls on both sides.
    for k, (name, url) in enumerate((("direct", direct), ("gateway", gateway), ("direct", direct))):
        if name == "gateway":
            before = await _metrics(gateway)
        span = seconds / 2 if name == "direct" else seconds
        # Prompts of their own in each part: none finds another part's in the prefix cache.
        ttfts = await _streams(url, streams, span, max_tokens, seed + k, first_id=k * 100_000_000)
        if not ttfts:
            raise RuntimeError(
                f"no stream sent after the {OVERHEAD_WARMUP_S:g} s warm-up completed in the overhead run "
                f"({name}, {span:g} s): each client may still have been on an earlier stream; "
                "raise --overhead-seconds or lower --overhead-tokens"
            )
        out[name] += ttfts
        if name == "gateway":
            after = await _metrics(gateway)
    added = _bucket_counts(after, ADDED) - _bucket_counts(before, ADDED)
    return {
        "overhead_p50_ms": round(_pct(out["gateway"], 0.5) - _pct(out["direct"], 0.5), 2),
        "overhead_p99_ms": round(_pct(out["gateway"], 0.99) - _pct(out["direct"], 0.99), 2),
        "direct_ttft_p50_ms": round(_pct(out["direct"], 0.5), 2),
        "direct_ttft_p99_ms": round(_pct(out["direct"], 0.99), 2),
        "gateway_ttft_p50_ms": round(_pct(out["gateway"], 0.5), 2),
        "gateway_ttft_p99_ms": round(_pct(out["gateway"], 0.99), 2),
        "overhead_requests": min(len(out["direct"]), len(out["gateway"])),
        "gateway_added_p50_ms": round(added.quantile(0.5) * 1000, 3),
        "gateway_added_p99_ms": round(added.quantile(0.99) * 1000, 3),
        "gateway_added_within_2ms": round(added.share_within(0.002), 4),
        **_queued(after),
    }


ADDED = "tierserve_gateway_added_seconds"


@dataclass(frozen=True)
class Buckets:
    """A Prometheus histogram's cumulative bucket counts: (upper bound, count), ascending."""

    counts: tuple[tuple[float, float], ...]

    def __sub__(self, other: Buckets) -> Buckets:
        was = dict(other.counts)
        return Buckets(tuple((le, n - was.get(le, 0.0)) for le, n in self.counts))

    def quantile(self, q: float) -> float:
        """As Prometheus's histogram_quantile: linear inside the bucket that holds rank q."""
        total = self.counts[-1][1] if self.counts else 0.0
        if total <= 0:
            return math.nan
        rank, lower, below = q * total, 0.0, 0.0
        for le, n in self.counts:
            if n >= rank:
                if math.isinf(le):
                    return lower  # past the last finite bound: all one can say
                return lower + (le - lower) * (rank - below) / max(n - below, 1e-12)
            lower, below = le, n
        return lower

    def share_within(self, bound: float) -> float:
        total = self.counts[-1][1] if self.counts else 0.0
        within = next((n for le, n in self.counts if math.isclose(le, bound)), math.nan)
        return within / total if total > 0 else math.nan


def _bucket_counts(metrics: str, name: str) -> Buckets:
    from prometheus_client.parser import text_string_to_metric_families

    counts = [
        (float(sample.labels["le"]), sample.value)
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == name + "_bucket"
    ]
    return Buckets(tuple(sorted(counts)))


def _queued(metrics: str) -> dict[str, float]:
    """How many of the overhead run's requests waited in the gateway's queue, and for how
    long in all (its flow control, not the proxy hop): from the gateway's own metrics."""
    from tierserve.gateway.saturation import metric_values

    def total(name: str) -> float:
        return sum(metric_values(metrics, f"tierserve_gateway_queue_wait_seconds_{name}"))

    return {"gateway_queued": total("count"), "gateway_queue_wait_s": round(total("sum"), 3)}


async def _capacity(url: str, clients: int, seconds: float, max_tokens: int) -> float:
    """Requests per second the fleet completes with `clients` always waiting on it; a probe
    that completes none fails, naming the answers it got."""
    done = 0
    failures: Counter[str] = Counter()
    stop = time.perf_counter() + seconds

    async def loop(k: int) -> None:
        nonlocal done
        i = 0
        while time.perf_counter() < stop:
            # Await first: `done += await ...` reads `done` before the await and loses
            # every completion counted meanwhile (it probed a sixteenth of the capacity).
            shot = await _shot(client, url, Tier.P1, max_tokens, k * 10_000 + i)
            done += shot.ok
            failures[shot.status] += not shot.ok
            i += 1

    start = time.perf_counter()
    async with _session(clients + 8) as client:
        await asyncio.gather(*(loop(k) for k in range(clients)))
    if not done:
        raise RuntimeError(
            f"the capacity probe completed no request in {seconds:g} s ({_answers(failures)}); "
            "a 400 may mean --max-tokens is past the model's context"
        )
    return done / (time.perf_counter() - start)


def _answers(failures: Counter[str]) -> str:
    """What the failed requests got, e.g. `400: 12`."""
    shown = ", ".join(f"{k}: {n}" for k, n in failures.most_common() if n)
    return f"answers {shown}" if shown else "no answer at all"


async def _open_loop(url: str, rate: float, seconds: float, max_tokens: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    tiers, weights = list(TIER_MIX), list(TIER_MIX.values())
    tasks: list[asyncio.Task[Shot]] = []
    async with _session(2048) as client:
        start = time.perf_counter()
        at = 0.0
        while at < seconds:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tier = rng.choices(tiers, weights)[0]
            tasks.append(asyncio.create_task(_shot(client, url, tier, max_tokens, len(tasks))))
            at += rng.expovariate(rate)
        shots = await asyncio.gather(*tasks)
    from tierserve.config import DEFAULT_TIERS

    result: dict[str, Any] = {}
    for tier in tiers:
        mine = [s for s in shots if s.tier == tier]
        target = DEFAULT_TIERS[tier].ttft_target_s
        met = [s for s in mine if s.ok and s.ttft_s is not None and s.ttft_s <= target]
        result[tier.name] = {
            "slo_attainment": round(len(met) / len(mine), 4) if mine else None,
            "goodput_rps": round(len(met) / seconds, 3),
            "sent": len(mine),
            # sent = ok + failed: a request refused or cut short counts against the SLO too
            "ok": sum(s.ok for s in mine),
            "failed": dict(sorted(Counter(s.status for s in mine if not s.ok).items())),
        }
    return result


FLOW_CONTROL = "[gateway]\nscrape_interval_s = 0.2\nmax_waiting = 1\nstale_after_s = 2.0\n"
LEAST_LOADED = "[gateway]\nscrape_interval_s = 0.2\nmax_waiting = 1000000\nmax_kv_usage = 1.0\n"
LEAST_LOADED += "affinity_load_bound = 1.0\nstale_after_s = 1000000.0\n"


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from tierserve.gateway.local_fleet import local_fleet

    one = "[gateway]\nscrape_interval_s = 0.5\n"
    with local_fleet(1, "", {"gw": one}) as urls:
        result: dict[str, Any] = asyncio.run(
            _overhead(
                urls["u0"], urls["gw"], args.streams, args.overhead_seconds, args.overhead_tokens, args.seed
            )
        )
    engine = f"[scheduler]\nmax_num_seqs = {args.max_seqs}\n"
    arms = {"flow_control": FLOW_CONTROL, "least_loaded": LEAST_LOADED}
    with local_fleet(args.replicas, engine, arms, args.upstream_policy) as urls:
        clients = 2 * args.max_seqs * args.replicas
        probe_s = min(CAPACITY_PROBE_MAX_S, max(CAPACITY_PROBE_MIN_S, args.duration / 3))
        capacity = asyncio.run(_capacity(urls["least_loaded"], clients, probe_s, args.max_tokens))
        rate = max(MIN_OFFERED_RPS, args.load * capacity)
        if rate * args.duration > MAX_OPEN_LOOP_REQUESTS:
            raise ValueError(
                f"--load {args.load:g} x the probed {capacity:.3g} req/s for --duration {args.duration:g} s "
                f"is {rate * args.duration:,.0f} requests an arm; at most {MAX_OPEN_LOOP_REQUESTS:,}"
            )
        if rate > args.load * capacity:
            result["offered_note"] = (
                f"offered {MIN_OFFERED_RPS:g} req/s, the least this bench offers, not --load "
                f"{args.load:g} x {capacity:.3g} req/s"
            )
        result["upstream_policy"] = args.upstream_policy
        result["capacity_rps"] = round(capacity, 3)
        result["offered_rps"] = round(rate, 3)
        for arm in arms:
            result[arm] = asyncio.run(_open_loop(urls[arm], rate, args.duration, args.max_tokens, args.seed))
    return result


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, before anything starts (None: nothing): the bench
    is bounded in replicas, streams, requests and time, and asks for no answer longer than
    the model's context (that failed after the overhead run, 35 s in)."""
    from tierserve.server.backends import build_backend

    for wrong, message in (
        (args.replicas > 16, f"need --replicas <= 16 (local processes), got {args.replicas}"),
        (args.streams > 2000, f"need --streams <= 2000, got {args.streams}"),
        (args.max_seqs > 1024, f"need --max-seqs <= 1024, got {args.max_seqs}"),
        (args.load > 100, f"need --load <= 100 (x the capacity), got {args.load:g}"),
        (args.duration > 3600, f"need --duration <= 3600 s, got {args.duration:g}"),
        (args.overhead_seconds > 3600, f"need --overhead-seconds <= 3600, got {args.overhead_seconds:g}"),
    ):
        if wrong:
            return message
    context = build_backend("sim", MODEL).executor.spec.max_model_len
    longest = max(3 * args.overhead_tokens // 2, args.max_tokens)  # overhead lengths: 0.5-1.5x
    if longest + PROMPT_TOKENS_MARGIN > context:
        return (
            f"--overhead-tokens (up to 1.5x) or --max-tokens asks for {longest} output tokens; "
            f"{MODEL}'s context is {context}"
        )
    return None


def run(args: argparse.Namespace) -> int:
    from tierserve.bench.output import emit, make_out_folder, source_commit

    if (wrong := check_args(args)) is not None:
        print(f"tierserve bench gateway: {wrong}", file=sys.stderr)
        return 2
    make_out_folder(args.out)  # a path that cannot be written fails now, not after the run
    commit = source_commit()  # the code that runs (a commit made during the run is not it)
    started = time.perf_counter()
    monitor = HostMonitor()
    result = measure(args)
    # What the run was asked for: the figures mean little without the streams, load and length.
    result["settings"] = {k: v for k, v in vars(args).items() if k not in ("func", "json", "out")}
    result["commit"] = commit
    result["wall_s"] = round(time.perf_counter() - started, 1)
    # The replicas, gateways and load share the host's cores with whatever else runs there.
    host = monitor.finish()
    result["host"] = host.as_dict()
    result["host_warning"] = host.warning()

    def table() -> None:
        print(
            "gateway overhead to first token, client side (gateway arm's percentile less the direct "
            f"arm's; noise can make it negative): P50 {result['overhead_p50_ms']:.2f} ms, "
            f"P99 {result['overhead_p99_ms']:.2f} ms ({args.streams} streams, "
            f"{result['overhead_requests']} requests per arm; direct TTFT P50 "
            f"{result['direct_ttft_p50_ms']:.1f} ms)"
        )
        print(
            f"the gateway's own time to first bytes: P50 {result['gateway_added_p50_ms']:.2f} ms, "
            f"P99 {result['gateway_added_p99_ms']:.2f} ms, "
            f"{result['gateway_added_within_2ms']:.1%} within 2 ms "
            f"({result['gateway_queued']:.0f} waited in its queue, "
            f"{result['gateway_queue_wait_s']:.2f} s in all)"
        )
        print(
            f"overload ({result['upstream_policy']} replicas): capacity {result['capacity_rps']} req/s, "
            f"offered {result['offered_rps']} req/s"
        )
        for arm in ("flow_control", "least_loaded"):
            cells = ", ".join(
                f"{t}: SLO {'-' if v['slo_attainment'] is None else v['slo_attainment']} of {v['sent']}, "
                f"goodput {v['goodput_rps']}/s" + (f", failed {v['failed']}" if v["failed"] else "")
                for t, v in result[arm].items()
            )
            print(f"  {arm:13s} {cells}")
        if "offered_note" in result:
            print(f"note: {result['offered_note']}")
        if result["host_warning"]:
            print(result["host_warning"])

    emit(result, args.out, args.json, table)
    return 0
