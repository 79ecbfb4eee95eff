"""Everything one gateway process holds, built from its config."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
import httpx

from tierserve.clock import Clock, WallClock
from tierserve.gateway.config import GatewayConfig, fail_open_by_tier
from tierserve.gateway.dispatcher import Dispatcher
from tierserve.gateway.flow import FlowControl
from tierserve.gateway.metrics import GatewayMetrics
from tierserve.gateway.router import Router
from tierserve.server.body_gate import BodyGate
from tierserve.server.body_parser import BodyParser
from tierserve.server.buckets import BucketBackend
from tierserve.server.ratelimit import RateLimiter
from tierserve.server.tenants import TenantResolver
from tierserve.server.uploads import Uploads

if TYPE_CHECKING:
    from tierserve.gateway.relay import Relay

log = logging.getLogger("tierserve.gateway")
MAX_CONNECTIONS = 1024
# An idle connection to an upstream is closed by the gateway before the upstream closes it:
# uvicorn (tierserve, vLLM, SGLang) closes one idle for 5 s, and a request sent on a
# connection the upstream had just closed failed with ServerDisconnectedError (aiohttp kept
# idle connections for 15 s), a 502 where the model has a single upstream.
UPSTREAM_KEEPALIVE_S = 4.0


@dataclass
class GatewayState:
    config: GatewayConfig
    clock: Clock
    router: Router
    flow: FlowControl
    dispatcher: Dispatcher
    limiter: RateLimiter
    tenants: TenantResolver
    metrics: GatewayMetrics
    client: httpx.AsyncClient  # scrapes and health checks: a few requests per interval
    # The requests themselves, opened with the event loop (`open_streams`). aiohttp, not
    # httpx: at 200 concurrent streams httpx's pool took 13-24 ms of CPU per request here.
    streams: aiohttp.ClientSession | None = None
    remote_buckets: Any = None  # RedisBuckets when configured (closed at shutdown)
    draining: bool = False
    uploads: Uploads = field(default_factory=Uploads)  # bodies coming in: draining refuses them
    body_parser: BodyParser = field(default_factory=BodyParser)  # large bodies, in a process of its own
    # At most `[server] large_body_queue` of them waiting for it (more get 503 `busy`), and
    # `large_body_queue_per_tenant` of one tenant's (429 `busy_tenant`), its time shared
    # fairly among tenants; not paced to a share of the time as the server paces them (no engine
    # shares this process).
    body_gate: BodyGate = field(default_factory=lambda: BodyGate(share=1.0))
    num_in_flight: int = 0  # requests between arrival and their last byte
    relays: set[Relay] = field(default_factory=set)  # streams being passed on (cut at the drain timeout)
    calls: set[asyncio.Task[Any]] = field(default_factory=set)  # non-streaming calls (likewise)
    # Attempts waiting for an upstream's reply (a stream's first events), by upstream: when
    # it is ejected they are cut and go to another (`cut_off`), not held to the read timeout.
    awaiting_reply: dict[str, set[asyncio.Task[Any]]] = field(default_factory=dict)
    cut_off: set[asyncio.Task[Any]] = field(default_factory=set)
    started_at: int = field(default_factory=lambda: int(time.time()))  # Unix seconds: the models' "created"
    _background: set[asyncio.Task[None]] = field(default_factory=set)

    def begin_draining(self) -> None:
        """Stop admitting (on the event loop); a body still uploading is refused now, unread
        (as `ServerState.begin_draining`)."""
        self.draining = True
        self.uploads.refuse_all()

    def open_streams(self) -> aiohttp.ClientSession:
        """The upstream session; made on first use, inside the running event loop."""
        if self.streams is None:
            settings = self.config.gateway
            self.streams = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=MAX_CONNECTIONS, limit_per_host=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S
                ),
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=settings.connect_timeout_s, sock_read=settings.read_timeout_s
                ),
            )
        return self.streams

    async def close_clients(self) -> None:
        await self.client.aclose()
        if self.streams is not None:
            await self.streams.close()
        await self.body_parser.aclose()

    def record_failure(
        self,
        name: str,
        why: str,
        *,
        eject_now: bool = False,
        unresponsive: bool = False,
        forwarded: bool = False,
    ) -> bool:
        """A failed health check or (`forwarded`) forwarded request to upstream `name` (`why`:
        one line); returns True when it ejects the upstream, then counted and said in one
        WARNING line, however it came (poller or forwarded request), and once: not again
        while it stays ejected. An upstream ejected by its requests is held out for a while
        (`Router.record_request_failure`). `unresponsive`: it failed by not answering at all
        (a timeout, a refused connection), and an ejection then cuts the requests waiting
        for its replies (`_cut_waiting`)."""
        router = self.router
        if forwarded:
            ejected = router.record_request_failure(name, eject_now=eject_now)
        else:
            ejected = router.record_failure(name, eject_now=eject_now)
        if ejected:
            self.metrics.ejections.labels(name).inc()
            log.warning("upstream %s ejected: %s", name, why)
        if unresponsive and not self.router.state(name).healthy:
            # Out, and silent now: ejected by this failure, or earlier while it still
            # answered (its /metrics failing), its requests would wait for the read timeout.
            self._cut_waiting(name)
        return ejected

    def _cut_waiting(self, name: str) -> None:
        """Cut the attempts still waiting for the ejected upstream's reply: nothing has reached
        their clients, so they may go to another upstream (a stopped upstream held them, P0's
        too, to the read timeout: 600 s by default). Only for an upstream that stopped
        answering: one that answers its checks with an error, or a draining tierserve whose
        /ready says 503, is still finishing what it has (cut, a lone draining upstream's
        requests got 502s). The attempt that ejected it goes on by itself."""
        waiting = self.awaiting_reply.get(name)
        if not waiting:
            return
        current = asyncio.current_task()
        for task in waiting - self.cut_off:
            if task is not current:
                self.cut_off.add(task)
                task.cancel()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` in the background; a failure is logged (not left for the event loop to
        report, if ever, as an exception never retrieved)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            log.error("a background task failed", exc_info=error)


def build_gateway_state(
    config: GatewayConfig, *, clock: Clock | None = None, remote_buckets: BucketBackend | None = None
) -> GatewayState:
    clock = clock or WallClock()
    serve, gw = config.serve, config.gateway
    rl = serve.server.ratelimit
    if remote_buckets is None and rl.backend == "redis":
        from tierserve.server.redis_buckets import RedisBuckets

        remote_buckets = RedisBuckets(rl.redis_url, timeout_s=rl.redis_timeout_s, key_prefix=rl.key_prefix)
    limiter = RateLimiter(
        serve.limits.global_limit,
        remote=remote_buckets,
        fail_open=rl.fail_mode == "open",
        tier_limits=gw.tier_limits,
        fail_open_tiers=fail_open_by_tier(config),
        local_share=1.0 / gw.instances,
    )
    router = Router(config.upstreams, gw, clock)
    flow = FlowControl(serve.engine, gw.policy, serve.limits.queue_caps, gw.max_wait_s, clock)
    metrics = GatewayMetrics()
    metrics.bind(router, flow, lambda: limiter)
    timeout = httpx.Timeout(connect=gw.connect_timeout_s, read=None, write=30.0, pool=gw.connect_timeout_s)
    client = httpx.AsyncClient(
        timeout=timeout,
        limits=httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_CONNECTIONS),
    )
    return GatewayState(
        config=config,
        clock=clock,
        router=router,
        flow=flow,
        dispatcher=Dispatcher(router, flow, metrics, clock),
        limiter=limiter,
        tenants=TenantResolver(serve),
        metrics=metrics,
        client=client,
        remote_buckets=remote_buckets,
        body_gate=BodyGate(
            share=1.0,
            max_waiting=serve.server.large_body_queue,
            max_waiting_per_tenant=serve.server.large_body_queue_per_tenant,
        ),
    )
