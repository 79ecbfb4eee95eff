"""Health checks and load scrapes of every upstream, each on a timer of its own.

A check fetches `/metrics` (or `/v1/models` for plain OpenAI endpoints, which export no
load), and `/ready` from tierserve upstreams, which say there when they drain (their
`/metrics` still answers). A success admits (or re-admits) the upstream and records its
load; failures in a row eject it. An upstream's model list is read from `/v1/models` at
each check until it is admitted, then every MODELS_REFRESH_S.

A check has one deadline for all of it (httpx's timeouts bound each read, and an answer
that trickles in a byte at a time never trips them), and each upstream is checked in a
loop of its own: one upstream's slow answers once held every other's scrape, their samples
went stale, the healthy upstreams counted as full, and requests waited in the gateway past
their tier's `max_wait_s` (the queues' expiry ran in the same loop). The queues are pumped
on a timer of their own.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

import httpx

from tierserve.gateway.router import UpstreamState
from tierserve.gateway.saturation import LoadSample, MetricsParseError, check_exposition, parse_load
from tierserve.gateway.state import GatewayState

MODELS_REFRESH_S = 30.0  # an admitted upstream's model list is read again this often

log = logging.getLogger("tierserve.gateway")


@dataclass(frozen=True, slots=True)
class ModelList:
    ids: frozenset[str]
    max_model_len: Mapping[str, int]  # vLLM's and tierserve's cards give it; OpenAI's do not


async def fetch_models(
    client: httpx.AsyncClient, url: str, timeout_s: float, headers: dict[str, str] | None = None
) -> ModelList:
    r = await client.get(url + "/v1/models", timeout=timeout_s, headers=headers)
    r.raise_for_status()
    body = r.json()
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise ValueError("/v1/models: not an OpenAI model list")
    cards = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
    lengths = {
        m["id"]: n
        for m in cards
        if isinstance(n := m.get("max_model_len"), int) and not isinstance(n, bool) and n > 0
    }
    return ModelList(frozenset(m["id"] for m in cards), lengths)


class NotReady(ValueError):
    """A tierserve upstream's `/ready` says it takes no new requests (draining, say)."""


async def check_ready(
    client: httpx.AsyncClient, url: str, timeout_s: float, headers: dict[str, str] | None = None
) -> None:
    r = await client.get(url + "/ready", timeout=timeout_s, headers=headers)
    if r.status_code == 503:
        try:
            body = r.json()
        except ValueError:
            body = None
        reason = body.get("reason", "not ready") if isinstance(body, dict) else "not ready"
        raise NotReady(f"/ready: {reason}")
    r.raise_for_status()


class UpstreamPoller:
    def __init__(self, gw: GatewayState) -> None:
        self._gw = gw
        settings = gw.config.gateway
        self._interval_s = settings.scrape_interval_s
        self._timeout_s = max(settings.connect_timeout_s, settings.scrape_interval_s)
        self._why_not: dict[str, str] = {}  # upstream -> why it was last not admitted (said once)
        # Upstreams admitted once: their failures are said in their ejection's line, not again.
        self._admitted: set[str] = set()
        self._models_at: dict[str, float] = {}  # upstream -> when its model list was last read

    async def _check(self, s: UpstreamState) -> None:
        gw = self._gw
        try:
            # Not `asyncio.wait_for`: on Python 3.11 it can swallow a cancel that arrives as
            # the check ends, and the watch loop then never stopped (a SIGTERM hung 1 in 10).
            async with asyncio.timeout(self._timeout_s):
                sample, models = await self._probe(s)
        except (httpx.HTTPError, MetricsParseError, ValueError, KeyError, TimeoutError) as e:
            if isinstance(e, TimeoutError):
                why = f"its health check took over {self._timeout_s:g} s"
            else:  # one line: httpx's status errors add a second ("For more information check: ...")
                why = (str(e).strip() or type(e).__name__).splitlines()[0]
            ejected = gw.record_failure(
                s.name,
                why,
                eject_now=isinstance(e, NotReady),  # draining: now
                unresponsive=isinstance(e, (TimeoutError, httpx.TimeoutException, httpx.ConnectError)),
            )
            if not ejected and s.name not in self._admitted and self._why_not.get(s.name) != why:
                # One that was never admitted failed in silence: say why, once per reason.
                log.warning("upstream %s (%s) not admitted: %s", s.name, s.config.url, why)
            self._why_not[s.name] = why
            return
        self._why_not.pop(s.name, None)
        if models is not None:
            self._models_at[s.name] = gw.clock.now()
        if sample is not None:
            gw.router.record_sample(s.name, sample)
        self._admitted.add(s.name)
        if models is not None:
            s.max_model_len = models.max_model_len
        if gw.router.record_success(s.name, None if models is None else models.ids):
            log.info("upstream %s admitted (models: %s)", s.name, ", ".join(sorted(s.models)) or "any")

    async def _probe(self, s: UpstreamState) -> tuple[LoadSample | None, ModelList | None]:
        """The upstream's load (None where it exports none) and, where it is asked for, its
        models; raises what makes the check fail."""
        gw, url, auth = self._gw, s.config.url, s.config.auth_headers
        sample = models = None
        if s.has_metrics:
            r = await gw.client.get(url + "/metrics", timeout=self._timeout_s, headers=auth)
            r.raise_for_status()
            try:
                sample = parse_load(s.config.kind, r.text, gw.clock.now())
            except MetricsParseError:
                # A fresh vLLM whose metrics are kept per process (PROMETHEUS_MULTIPROC_DIR)
                # exports its load gauges only after its first request: a replica that
                # answers valid metrics and has never reported load is idle, not broken.
                # An answer that is not metrics (a proxy's HTML page) fails the check.
                check_exposition(r.text, r.headers.get("content-type"))
                models = await fetch_models(gw.client, url, self._timeout_s, auth)
                sample = LoadSample(0.0, 0.0, 0.0, gw.clock.now())
            # Read again now and then: an upstream restarted with another model between two
            # checks, or a URL behind a load balancer, kept its old list for good (404s).
            stale = gw.clock.now() - self._models_at.get(s.name, -math.inf) >= MODELS_REFRESH_S
            if models is None and (not s.healthy or not s.models or stale):
                models = await fetch_models(gw.client, url, self._timeout_s, auth)
        else:
            models = await fetch_models(gw.client, url, self._timeout_s, auth)
        if s.config.kind == "tierserve":
            await check_ready(gw.client, url, self._timeout_s, auth)
        return sample, models

    async def poll_once(self) -> None:
        """Check every upstream once, at the same time (before serving, and in tests)."""
        await asyncio.gather(*(self._check(s) for s in self._gw.router.states))
        self._gw.dispatcher.pump()

    async def run(self) -> None:
        """Until cancelled: each upstream checked in a loop of its own, one interval after its
        last check ended (an upstream added later starts within a tick), and the queues
        pumped (aging, expiry) five times an interval."""
        ticks = 5
        watches: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                for s in self._gw.router.states:
                    if s.name not in watches:
                        watches[s.name] = asyncio.get_running_loop().create_task(self._watch(s))
                self._gw.dispatcher.pump()
                await asyncio.sleep(self._interval_s / ticks)
        finally:
            for task in watches.values():
                task.cancel()
            if watches:  # bounded: a check that did not stop must not hold the shutdown
                await asyncio.wait(watches.values(), timeout=self._timeout_s + 1.0)

    async def _watch(self, s: UpstreamState) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self._check(s)
            except Exception:  # a reply no check foresaw: its loop must not end in silence
                log.exception("health check of upstream %s failed unexpectedly", s.name)
                self._gw.record_failure(s.name, "its health check failed unexpectedly")
            self._gw.dispatcher.pump()
