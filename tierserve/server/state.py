"""Everything one server instance holds, built from a config and an executor."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from tierserve.clock import Clock, WallClock
from tierserve.engine import Engine
from tierserve.executors.base import Executor
from tierserve.server.admission import AdmissionController, ThroughputMeter
from tierserve.server.async_engine import AsyncEngine
from tierserve.server.buckets import BucketBackend
from tierserve.server.config import ServeConfig
from tierserve.server.metrics import ServerMetrics
from tierserve.server.ratelimit import RateLimiter
from tierserve.server.served_executor import ServedExecutor
from tierserve.server.state_metrics import LimiterState
from tierserve.server.tenants import TenantResolver
from tierserve.server.tokenizer import Tokenizer
from tierserve.server.tracing import ServeTrace
from tierserve.tiers import ALL_TIERS, Tier

log = logging.getLogger("tierserve.server")


@dataclass(frozen=True)
class ModelInfo:
    name: str  # the id clients pass as `model`
    max_model_len: int
    vocab_size: int
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class ServerState:
    config: ServeConfig
    model: ModelInfo
    tokenizer: Tokenizer
    engine: AsyncEngine
    limiter: RateLimiter
    admission: AdmissionController
    tenants: TenantResolver
    metrics: ServerMetrics
    clock: Clock
    block_size: int
    ceiling_blocks: dict[Tier, int]  # the most KV blocks one tier may hold (fixed at start)
    remote_buckets: Any = None  # RedisBuckets when configured (closed at shutdown)
    trace: ServeTrace | None = None  # set before create_app to record per-request timestamps
    draining: bool = False
    _background: set[asyncio.Task[None]] = field(default_factory=set)
    _ids: itertools.count[int] = field(default_factory=itertools.count)
    _id_prefix: str = field(default_factory=lambda: os.urandom(3).hex())  # tells replicas' ids apart

    def new_request_id(self, kind: str) -> str:
        return f"{kind}-{self._id_prefix}{next(self._ids):09x}"

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` without awaiting it (e.g. settling a rate limit after a disconnect)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def describe(self) -> str:
        c = self.config
        if c.source is None:
            access = "OPEN: no config file, no API keys, no rate limits"
        elif not c.requires_key:
            access = f"OPEN: no API keys in {c.source}; tenants by x-tenant-id"
        else:
            access = f"API keys required ({len(c.tenants)} tenants from {c.source})"
        return f"model {self.model.name!r} (context {self.model.max_model_len}); access: {access}"


def build_state(
    config: ServeConfig,
    executor: Executor,
    tokenizer: Tokenizer,
    *,
    model_name: str,
    vocab_size: int,
    policy: str = "hybrid",
    pace: bool = False,
    clock: Clock | None = None,
    remote_buckets: BucketBackend | None = None,
) -> ServerState:
    """Wire engine, limits, admission and metrics. `pace`: sleep the executor's predicted durations."""
    clock = clock or WallClock()
    engine_config = config.engine
    metrics = ServerMetrics(model_name, {t: engine_config.tiers[t].ttft_target_s for t in ALL_TIERS})
    served = ServedExecutor(executor, metrics.swap, pace=pace)
    engine = Engine(engine_config, policy, served, clock)
    meter = ThroughputMeter()
    async_engine = AsyncEngine(engine, metrics=metrics, meter=meter)
    rl = config.server.ratelimit
    if remote_buckets is None and rl.backend == "redis":
        from tierserve.server.redis_buckets import RedisBuckets

        remote_buckets = RedisBuckets(rl.redis_url, timeout_s=rl.redis_timeout_s, key_prefix=rl.key_prefix)
    limiter = RateLimiter(config.limits.global_limit, remote=remote_buckets, fail_open=rl.fail_mode == "open")
    metrics.bind(lambda: async_engine.snapshot, lambda: LimiterState(limiter.redis_up, limiter.num_fallbacks))
    spec = executor.spec
    return ServerState(
        config=config,
        model=ModelInfo(model_name, spec.max_model_len, vocab_size),
        tokenizer=tokenizer,
        engine=async_engine,
        limiter=limiter,
        admission=AdmissionController(engine_config.tiers, config.limits.queue_caps, meter),
        tenants=TenantResolver(config),
        metrics=metrics,
        clock=clock,
        block_size=spec.block_size,
        ceiling_blocks={t: engine.memory.partition.ceiling[t] for t in ALL_TIERS},
        remote_buckets=remote_buckets,
    )
