"""One `bench fleet` invocation: the deployment, the trace and one run per (router, scaling)."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from tierserve.bench.cell import BenchSetup
from tierserve.bench.idle import IdleTtft
from tierserve.clock import VirtualClock
from tierserve.config import ConfigError, load_raw
from tierserve.engine import Engine
from tierserve.executors.sim.executor import build_sim_executor
from tierserve.executors.sim.gpus import get_gpu
from tierserve.fleet.autoscaler import AutoscaleConfig, ScalingPolicy
from tierserve.fleet.sim import FleetConfig, FleetSim
from tierserve.fleet.summary import summarize
from tierserve.gateway.config import GatewaySettings, parse_gateway_settings
from tierserve.workloads import RequestSpec, TierMix, WorkloadPreset, get_preset, load_trace, trace_stream
from tierserve.workloads.trace_stream import num_cut_to_fit, replay_count

WORKLOAD = "default"  # each replica: this workload's model on its GPUs
# Bounds on one run, checked before it starts. The gateway scrapes every replica every
# 0.5 virtual seconds and the autoscaler decides on its interval, busy or idle, so the CPU
# a run takes grows with its virtual span as well as with its requests.
MAX_SPAN_S = 31 * 86_400.0  # a month of virtual time
MAX_REQUESTS = 10_000_000  # about 3 CPU-hours at a fleet's ~1,000 requests per CPU-second
MAX_BINS = 100_000  # over-time bins in the summary and the plots


def _deployment(args: argparse.Namespace) -> WorkloadPreset:
    """Each replica's model, GPUs and tensor parallelism: the default workload's (Llama-3.1-70B
    on 8 x A100-80GB) unless `--model`, `--gpu` or `--tp` say otherwise. Another model alone
    runs on one GPU of the default kind unless `--tp` is given."""
    base = get_preset(WORKLOAD)
    model = getattr(args, "model", None) or base.model
    tp = getattr(args, "tp", None) or (base.tp if model == base.model else 1)
    gpu = get_gpu(getattr(args, "gpu", None) or base.gpu).name  # "h100" is h100-80gb
    return replace(base, model=model, gpu=gpu, tp=tp)


# The `[gateway]` settings the simulated gateway reads: its flow control (the tier queues'
# order and wait caps), the router's judgement of a full replica and of staleness, prefix
# affinity's load bound, the scrapes and the retries. The others (Redis, rate limits,
# ejection on failed checks or requests, timeouts, instances, `prefix_chars`: the simulation
# keys prefixes on token ids) act on what the simulation does not model.
SIMULATED_GATEWAY_KEYS = (
    "policy",
    "max_wait_s",
    "max_waiting",
    "max_kv_usage",
    "stale_after_s",
    "scrape_interval_s",
    "affinity_load_bound",
    "max_attempts",
)


def _check_fits(preset: WorkloadPreset) -> None:
    """Refuse, naming the smallest --tp that fits (as `tierserve profile` does), a replica whose
    weights leave no room for its K/V cache."""
    from tierserve.executors.sim.profile_cli import does_not_fit, profile

    reason = does_not_fit(profile(preset.model, preset.gpu, preset.tp))
    if reason is not None:
        raise ValueError(reason)


def _gateway_settings(path: Path | None) -> GatewaySettings:
    """`[gateway]` of the file at `path` (the gateway's defaults without one); the file's
    other sections ([[upstreams]], [tiers], tenants) are the deployment's, not the fleet's."""
    if path is None:
        return GatewaySettings()
    raw = load_raw(path)
    if "gateway" not in raw:  # a misspelt [gatway] ran the defaults without a word
        raise ConfigError(f"{path}: no [gateway] table (the fleet reads only its [gateway] settings)")
    try:
        return parse_gateway_settings(raw, source=str(path))
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def settings_json(settings: GatewaySettings) -> dict[str, Any]:
    """The simulated gateway's settings, for results.json (tiers by name)."""
    out: dict[str, Any] = {}
    for key in SIMULATED_GATEWAY_KEYS:
        value = getattr(settings, key)
        out[key] = {t.name: v for t, v in value.items()} if isinstance(value, Mapping) else value
    return out


class FleetBench:
    def __init__(self, args: argparse.Namespace, trace: Path) -> None:
        self.args = args
        self.trace = trace
        self.rows = load_trace(trace, args.max_requests)
        if not self.rows:
            raise ValueError(f"{trace}: no requests")
        self._check_size()
        self.preset = _deployment(args)
        _check_fits(self.preset)
        self.settings = _gateway_settings(getattr(args, "gateway_config", None))
        self.setup = BenchSetup(tier_mix=args.tier_mix)
        self.engine_config = self.setup.engine_config()
        self.max_model_len = self._executor().spec.max_model_len
        self.num_requests = replay_count(self.rows, args.seed, args.rate_scale, args.scale_by)
        if not self.num_requests:
            raise ValueError(
                f"--rate-scale {args.rate_scale:g} --scale-by copies keeps none of the trace's "
                f"{len(self.rows)} rows (about {args.rate_scale * len(self.rows):.2g} requests expected)"
            )

    def _check_size(self) -> None:
        """Refuse, before anything runs, a run that could not end in reasonable time or memory:
        too many requests, too long a virtual span, too many over-time bins."""
        a, rows = self.args, self.rows
        if a.scale_by == "copies" and a.rate_scale * len(rows) > MAX_REQUESTS:
            raise ValueError(
                f"--rate-scale {a.rate_scale:g} --scale-by copies makes about {a.rate_scale * len(rows):.3g} "
                f"requests from {len(rows)} rows; at most {MAX_REQUESTS:,} in one run"
            )
        span_s = rows[-1].arrival_s - rows[0].arrival_s
        if a.scale_by == "time":
            span_s /= a.rate_scale
        if span_s > MAX_SPAN_S:
            raise ValueError(
                f"the trace at --rate-scale {a.rate_scale:g} spans {span_s / 86_400:.3g} days of virtual "
                f"time; at most {MAX_SPAN_S / 86_400:g} (the gateway scrapes every replica every 0.5 s "
                "of it): raise --rate-scale, cut the trace, or check its timestamps' unit (Mooncake's "
                "are milliseconds, BurstGPT's seconds)"
            )
        if a.drain_timeout_s > MAX_SPAN_S:
            raise ValueError(f"--drain-timeout-s must be at most {MAX_SPAN_S:g} s, got {a.drain_timeout_s:g}")
        num_bins = (span_s + a.drain_timeout_s) / a.bin_s
        if num_bins > MAX_BINS:
            raise ValueError(
                f"--bin-s {a.bin_s:g} cuts the run (up to {span_s + a.drain_timeout_s:.3g} s) into "
                f"{num_bins:.3g} bins; at most {MAX_BINS:,}: use a wider --bin-s"
            )

    def _executor(self) -> Any:
        p = self.preset
        return build_sim_executor(p.model, p.gpu, p.tp)

    def build_engine(self, clock: VirtualClock) -> Engine:
        fast = self.args.sim_mode == "fast"
        return Engine(self.engine_config, self.args.policy, self._executor(), clock, fast=fast)

    def specs(self) -> Iterator[RequestSpec]:
        mix = TierMix.parse(self.args.tier_mix)
        a = self.args
        return trace_stream(self.rows, a.seed, self.max_model_len, mix, a.rate_scale, a.scale_by)

    def config(self, router: str, scaling: str) -> FleetConfig:
        a = self.args
        return FleetConfig(
            a.replicas,
            router,
            self.autoscale_config(scaling),
            settings=self.settings,
            num_gpus_per_replica=self.preset.tp,
            kills=_kills(a),
            drain_timeout_s=a.drain_timeout_s,
        )

    def autoscale_config(self, scaling: str) -> AutoscaleConfig:
        a = self.args
        return AutoscaleConfig(
            ScalingPolicy(scaling),
            min_replicas=min(a.min_replicas, a.replicas),
            # A fixed fleet never grows: --max-replicas is the autoscalers' bound only.
            max_replicas=a.replicas if scaling == "fixed" else max(a.max_replicas, a.replicas),
            startup_delay_s=a.startup_delay_s,
            interval_s=a.scale_interval_s,
            idle_s=a.idle_s,
        )

    def run(self, router: str, scaling: str) -> dict[str, Any]:
        from tierserve.bench.output import progress_bar

        # The tier policy counts only the P0 requests that more replicas could bring within
        # the target (observe.py); the other policies do not read P0's attainment.
        alone = (
            IdleTtft(self.engine_config, self._executor()) if scaling == ScalingPolicy.TIER.value else None
        )
        sim = FleetSim(self.config(router, scaling), self.build_engine, alone)
        started = time.process_time()
        # Requests ended (answered, refused or lost), not arrived: the drain after the last
        # arrival is part of the run.
        with progress_bar(total=self.num_requests, desc=f"{router}/{scaling}", unit="req") as bar:
            sim.on_end = lambda: bar.update(1)
            result = sim.run(self.specs())
        cpu_s = time.process_time() - started
        summary = summarize(result, self.engine_config, self.args.bin_s)
        return {
            "router": router,
            "scaling": scaling,
            "cpu_s": cpu_s,
            "requests_per_cpu_s": len(result.requests) / cpu_s if cpu_s > 0 else None,
            "summary": summary,
        }

    def meta(self, commit: str | None, cpu_s: float) -> dict[str, Any]:
        load = os.getloadavg()[0]
        cores = os.cpu_count() or 1
        return {
            "trace": str(self.trace),
            "rate_scale": self.args.rate_scale,
            "scale_by": self.args.scale_by,
            "num_trace_rows": len(self.rows),
            "num_rows_cut_to_context": num_cut_to_fit(self.rows, self.max_model_len),
            "max_model_len": self.max_model_len,
            "num_requests": self.num_requests,
            "replicas": self.args.replicas,
            "model": self.preset.model,
            "gpu": self.preset.gpu,
            "tp": self.preset.tp,
            "policy": self.args.policy,
            "sim_mode": self.args.sim_mode,
            "tier_mix": self.args.tier_mix,
            "seed": self.args.seed,
            "startup_delay_s": self.args.startup_delay_s,
            # The autoscaler's settings (what a run with --autoscale needs to be run again).
            "min_replicas": self.args.min_replicas,
            "max_replicas": self.args.max_replicas,
            "scale_interval_s": self.args.scale_interval_s,
            "idle_s": self.args.idle_s,
            "bin_s": self.args.bin_s,
            "drain_timeout_s": self.args.drain_timeout_s,
            "kills": [list(k) for k in _kills(self.args)],
            "gateway_config": str(path) if (path := getattr(self.args, "gateway_config", None)) else None,
            "gateway": settings_json(self.settings),
            "commit": commit,
            "cpu_s": cpu_s,
            "load_average": load,
            "busy_host": load > 0.75 * cores,
        }


def _kills(args: argparse.Namespace) -> tuple[tuple[float, int], ...]:
    """`--kill`'s (time, replica) pairs (parsed by `bench/fleet_bench.parse_kill`)."""
    return tuple(args.kill)
