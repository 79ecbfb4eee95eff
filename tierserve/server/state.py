"""Everything one server instance holds, built from a config and an executor."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from tierserve.clock import Clock, WallClock
from tierserve.request import SamplingDefaults
from tierserve.server.admission import AdmissionController, ThroughputMeter
from tierserve.server.backends import Backend
from tierserve.server.body_parser import BodyParser
from tierserve.server.buckets import BucketBackend
from tierserve.server.config import ServeConfig
from tierserve.server.engine_client import EngineClient
from tierserve.server.engine_messages import EngineRecipe
from tierserve.server.engine_service import EngineService
from tierserve.server.metrics import ServerMetrics
from tierserve.server.ratelimit import RateLimiter
from tierserve.server.state_metrics import LimiterState
from tierserve.server.tenants import TenantResolver
from tierserve.server.tokenizer import Tokenizer
from tierserve.server.tracing import ServeTrace
from tierserve.server.uploads import Uploads
from tierserve.tiers import ALL_TIERS, Tier

log = logging.getLogger("tierserve.server")


@dataclass(frozen=True)
class ModelInfo:
    name: str  # the id clients pass as `model`
    max_model_len: int
    vocab_size: int
    context_note: str = ""  # why max_model_len is below the model's positions, to end a refusal with
    # The model's own sampling settings, for the fields a request leaves out (as vLLM).
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class ServerState:
    config: ServeConfig
    model: ModelInfo
    tokenizer: Tokenizer
    engine: EngineService
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
    engine_stalled: bool = False  # /ready found the engine silent past `engine_stall_s` (logged once)
    body_parser: BodyParser = field(default_factory=BodyParser)  # large bodies, in a process of its own
    uploads: Uploads = field(default_factory=Uploads)  # bodies coming in: draining refuses them
    _background: set[asyncio.Task[None]] = field(default_factory=set)
    _ids: itertools.count[int] = field(default_factory=itertools.count)
    # Tells processes' ids apart: with 3 bytes, two of 1,000 server starts (replicas,
    # restarts) shared a prefix, and so the ids of their first requests, 3 % of the time.
    _id_prefix: str = field(default_factory=lambda: os.urandom(8).hex())

    def begin_draining(self) -> None:
        """Stop admitting (call on the event loop). A request still uploading its body is
        refused now with 503 `draining`, unread: it could never be admitted, and a stalled
        upload held the shutdown until uvicorn cancelled it into a 500 and a traceback."""
        self.draining = True
        self.uploads.refuse_all()

    def not_ready(self) -> str | None:
        """Why /ready should answer 503, or None: the engine loop gone, a drain, or an engine
        that has had work and sent nothing for `server.engine_stall_s` (logged once a stall)."""
        if self.draining:
            return "draining"
        if not self.engine.running:
            return "engine loop not running"
        limit = self.config.server.engine_stall_s
        silent = self.engine.silent_s()
        stalled = 0 < limit <= silent
        if stalled != self.engine_stalled:
            self.engine_stalled = stalled
            if stalled:
                log.warning(
                    "engine process %d has sent nothing for %.0f s (requests in flight: %d); "
                    "/ready answers 503 until it does (server.engine_stall_s = %g)",
                    self.engine.pid,
                    silent,
                    self.engine.num_in_flight,
                    limit,
                )
            else:
                log.info("engine process %d is answering again; /ready answers 200", self.engine.pid)
        return f"engine silent for {silent:.0f} s with work in flight" if stalled else None

    def new_request_id(self, kind: str) -> str:
        return f"{kind}-{self._id_prefix}{next(self._ids):09x}"

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` without awaiting it (e.g. settling a rate limit after a disconnect)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def describe(self) -> str:
        c = self.config
        default = c.server.default_tenant
        if not c.tenants:  # open: x-tenant-id labels an ad-hoc tenant, whatever tenant_header says
            anonymous = (
                f"requests run as tenant {default!r}, or as the ad-hoc tenant their x-tenant-id names "
                "(for fair sharing; no limits of its own)"
            )
        elif c.server.tenant_header:
            anonymous = (
                f"x-tenant-id selects a declared tenant; other anonymous requests run as tenant {default!r}"
            )
        else:
            anonymous = f"anonymous requests run as tenant {default!r} (x-tenant-id is ignored)"
        if c.source is None:
            access = f"OPEN: no config file, no API keys, no rate limits; {anonymous}"
        elif not c.requires_key:
            if c.has_keys:
                access = f"OPEN (allow_anonymous): API keys in {c.source} name tenants; {anonymous}"
            else:
                access = f"OPEN: no API keys in {c.source}; {anonymous}"
        else:
            num = len(c.tenants)
            access = f"API keys required ({num} tenant{'' if num == 1 else 's'} from {c.source})"
        why = self.model.context_note.strip().removeprefix("(").removesuffix(")")  # a window, the cache
        context = f"context {self.model.max_model_len}" + (f", {why}" if why else "")
        return f"model {self.model.name!r} ({context}); access: {access}"


def spawn_state(
    config: ServeConfig,
    backend: Callable[[], Backend],
    *,
    policy: str = "hybrid",
    remote_buckets: BucketBackend | None = None,
    log_level: str = "INFO",
) -> ServerState:
    """Start the engine in a process of its own and wire the HTTP side to it.

    `backend` is called in the engine process (it must pickle by name: a `BackendSpec`, or a
    module-level function); the model is loaded there, and its tokenizer comes back."""
    clock = WallClock()
    engine_config = config.engine
    targets = {t: engine_config.tiers[t].ttft_target_s for t in ALL_TIERS}
    recipe = EngineRecipe(engine_config, policy, backend, targets, clock.origin, log_level)
    meter = ThroughputMeter()
    client = EngineClient.spawn(recipe, meter)
    ready = client.ready
    metrics = ServerMetrics(ready.model_name, targets)
    state = _assemble(
        config,
        client,
        metrics,
        meter,
        ModelInfo(
            ready.model_name,
            ready.max_model_len,
            ready.vocab_size,
            ready.context_note,
            ready.sampling_defaults,
        ),
        ready.tokenizer,
        clock,
        ready.block_size,
        dict(ready.ceiling_blocks),
        remote_buckets,
    )
    # The state gauges read the snapshot that comes with every step (the engine process's own
    # are left at zero); its counters and histograms are merged in at scrape.
    metrics.bind(lambda: client.snapshot, None)
    return state


def _assemble(
    config: ServeConfig,
    engine: EngineService,
    metrics: ServerMetrics,
    meter: ThroughputMeter,
    model: ModelInfo,
    tokenizer: Tokenizer,
    clock: Clock,
    block_size: int,
    ceiling_blocks: dict[Tier, int],
    remote_buckets: BucketBackend | None,
) -> ServerState:
    """The HTTP side's parts around an engine: limits, admission, tenants, metrics."""
    rl = config.server.ratelimit
    if remote_buckets is None and rl.backend == "redis":
        from tierserve.server.redis_buckets import RedisBuckets

        remote_buckets = RedisBuckets(rl.redis_url, timeout_s=rl.redis_timeout_s, key_prefix=rl.key_prefix)
    limiter = RateLimiter(config.limits.global_limit, remote=remote_buckets, fail_open=rl.fail_mode == "open")
    metrics.bind(None, lambda: LimiterState(limiter.redis_up, limiter.num_fallbacks))
    return ServerState(
        config=config,
        model=model,
        tokenizer=tokenizer,
        engine=engine,
        limiter=limiter,
        admission=AdmissionController(config.engine.tiers, config.limits.queue_caps, meter),
        tenants=TenantResolver(config),
        metrics=metrics,
        clock=clock,
        block_size=block_size,
        ceiling_blocks=ceiling_blocks,
        remote_buckets=remote_buckets,
    )
