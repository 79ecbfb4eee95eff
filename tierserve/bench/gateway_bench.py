"""`tierserve bench gateway`: what the gateway adds, and what its flow control buys.

Local replicas (`serve --backend sim`, in their own processes) and gateways in front of
them, loopback only, bounded in requests and time:

1. Overhead: `--streams` concurrent streams to one replica directly, then through a
   gateway with that replica alone; the added time to the first token is the difference
   of the P50s and of the P99s (client side: it holds the gateway's extra hop).
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
import random
import time
from dataclasses import dataclass
from typing import Any

from tierserve.tiers import Tier

MODEL = "llama-3.1-70b"
TIER_MIX = {Tier.P0: 0.2, Tier.P1: 0.3, Tier.P2: 0.5}
REQUEST_TIMEOUT_S = 30.0
# The closed-loop probe of the fleet's capacity: long enough for many requests to complete
# (3 s gave 0.63 requests/s for two replicas, and an overload arm of 7 requests).
CAPACITY_PROBE_MIN_S, CAPACITY_PROBE_MAX_S = 3.0, 10.0


@dataclass(frozen=True, slots=True)
class Shot:
    tier: Tier
    ok: bool
    ttft_s: float | None


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "gateway", help="the gateway's added latency and its flow control under overload"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument(
        "--streams", type=int, default=200, help="concurrent streams for the overhead (default 200)"
    )
    p.add_argument("--replicas", type=int, default=2, help="local replicas (default 2)")
    p.add_argument("--max-seqs", type=int, default=4, help="running requests per replica in the overload run")
    p.add_argument(
        "--load", type=float, default=1.2, help="offered load, x the probed capacity (default 1.2)"
    )
    p.add_argument(
        "--duration", type=float, default=30.0, help="seconds of open-loop load per arm (default 30)"
    )
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix (default: 0)")
    p.set_defaults(func=run)


async def _shot(client: Any, url: str, tier: Tier, max_tokens: int, i: int) -> Shot:
    import httpx

    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"request {i}: tell me something"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    start = time.perf_counter()
    ttft = None
    try:
        async with client.stream(
            "POST", url + "/v1/chat/completions", json=body, headers={"x-request-tier": tier.name}
        ) as r:
            if r.status_code != 200:
                await r.aread()
                return Shot(tier, False, None)
            tail = b""
            async for chunk in r.aiter_bytes():
                if ttft is None and b'"content": "' in chunk.replace(b'"content": ""', b""):
                    ttft = time.perf_counter() - start
                tail = (tail + chunk)[-64:]
            return Shot(tier, b"[DONE]" in tail and b'"error"' not in tail, ttft)
    except httpx.HTTPError:
        return Shot(tier, False, ttft)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _overhead(direct: str, gateway: str, streams: int, max_tokens: int) -> dict[str, float]:
    import httpx

    limits = httpx.Limits(max_connections=streams + 8)
    out: dict[str, list[float]] = {}
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        for name, url in (("direct", direct), ("gateway", gateway)):
            await _shot(client, url, Tier.P1, 1, -1)  # warm the connection pool and the route
            shots = await asyncio.gather(
                *(_shot(client, url, Tier.P1, max_tokens, i) for i in range(streams))
            )
            out[name] = [s.ttft_s * 1000 for s in shots if s.ok and s.ttft_s is not None]
        metrics = (await client.get(gateway + "/metrics")).text
    if not out["direct"] or not out["gateway"]:
        raise RuntimeError("no stream completed in the overhead run")
    return {
        "overhead_p50_ms": _pct(out["gateway"], 0.5) - _pct(out["direct"], 0.5),
        "overhead_p99_ms": _pct(out["gateway"], 0.99) - _pct(out["direct"], 0.99),
        "direct_ttft_p50_ms": _pct(out["direct"], 0.5),
        "gateway_ttft_p50_ms": _pct(out["gateway"], 0.5),
        **_queued(metrics),
    }


def _queued(metrics: str) -> dict[str, float]:
    """How many of the overhead run's requests waited in the gateway's queue, and for how
    long in all (its flow control, not the proxy hop): from the gateway's own metrics."""
    from tierserve.gateway.saturation import metric_values

    def total(name: str) -> float:
        return sum(metric_values(metrics, f"tierserve_gateway_queue_wait_seconds_{name}"))

    return {"gateway_queued": total("count"), "gateway_queue_wait_s": round(total("sum"), 3)}


async def _capacity(url: str, clients: int, seconds: float, max_tokens: int) -> float:
    """Requests per second the fleet completes with `clients` always waiting on it."""
    import httpx

    done = 0
    stop = time.perf_counter() + seconds

    async def loop(k: int) -> None:
        nonlocal done
        i = 0
        while time.perf_counter() < stop:
            # Await first: `done += await ...` reads `done` before the await and loses
            # every completion counted meanwhile (it probed a sixteenth of the capacity).
            shot = await _shot(client, url, Tier.P1, max_tokens, k * 10_000 + i)
            done += shot.ok
            i += 1

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        await asyncio.gather(*(loop(k) for k in range(clients)))
    return done / (time.perf_counter() - start)


async def _open_loop(url: str, rate: float, seconds: float, max_tokens: int, seed: int) -> dict[str, Any]:
    import httpx

    rng = random.Random(seed)
    tiers, weights = list(TIER_MIX), list(TIER_MIX.values())
    tasks: list[asyncio.Task[Shot]] = []
    async with httpx.AsyncClient(
        timeout=REQUEST_TIMEOUT_S, limits=httpx.Limits(max_connections=2048)
    ) as client:
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
        }
    return result


FLOW_CONTROL = "[gateway]\nscrape_interval_s = 0.2\nmax_waiting = 1\nstale_after_s = 2.0\n"
LEAST_LOADED = "[gateway]\nscrape_interval_s = 0.2\nmax_waiting = 1000000\nmax_kv_usage = 1.0\n"
LEAST_LOADED += "affinity_load_bound = 1.0\nstale_after_s = 1000000.0\n"


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from tierserve.gateway.local_fleet import local_fleet

    one = "[gateway]\nscrape_interval_s = 0.5\n"
    with local_fleet(1, "", {"gw": one}) as urls:
        result: dict[str, Any] = asyncio.run(_overhead(urls["u0"], urls["gw"], args.streams, 8))
    engine = f"[scheduler]\nmax_num_seqs = {args.max_seqs}\n"
    arms = {"flow_control": FLOW_CONTROL, "least_loaded": LEAST_LOADED}
    with local_fleet(args.replicas, engine, arms) as urls:
        clients = 2 * args.max_seqs * args.replicas
        probe_s = min(CAPACITY_PROBE_MAX_S, max(CAPACITY_PROBE_MIN_S, args.duration / 3))
        capacity = asyncio.run(_capacity(urls["least_loaded"], clients, probe_s, args.max_tokens))
        rate = max(0.5, args.load * capacity)
        result["capacity_rps"] = round(capacity, 3)
        result["offered_rps"] = round(rate, 3)
        for arm in arms:
            result[arm] = asyncio.run(_open_loop(urls[arm], rate, args.duration, args.max_tokens, args.seed))
    return result


def run(args: argparse.Namespace) -> int:
    from tierserve.bench.output import emit

    started = time.perf_counter()
    result = measure(args)
    result["wall_s"] = round(time.perf_counter() - started, 1)

    def table() -> None:
        print(
            f"gateway overhead to first token: P50 {result['overhead_p50_ms']:.2f} ms, "
            f"P99 {result['overhead_p99_ms']:.2f} ms ({args.streams} streams; "
            f"{result['gateway_queued']:.0f} waited in the gateway's queue, "
            f"{result['gateway_queue_wait_s']:.2f} s in all)"
        )
        print(f"overload: capacity {result['capacity_rps']} req/s, offered {result['offered_rps']} req/s")
        for arm in ("flow_control", "least_loaded"):
            cells = ", ".join(
                f"{t}: SLO {v['slo_attainment']}, goodput {v['goodput_rps']}/s"
                for t, v in result[arm].items()
            )
            print(f"  {arm:13s} {cells}")

    emit(result, args.out, args.json, table)
    return 0
