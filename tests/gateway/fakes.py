"""A fake vLLM-like upstream (in a thread) and an in-process gateway, for fault tests."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from tierserve.gateway.app import create_gateway_app
from tierserve.gateway.config import GatewayConfig, parse_gateway_config
from tierserve.gateway.drain import DrainingGateway
from tierserve.gateway.state import GatewayState, build_gateway_state
from tierserve.server.embedded import loopback_socket

FAKE_MODEL = "fake"
METRICS = "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0.1\n"


def _event(i: int, last: bool) -> bytes:
    chunk = {
        "choices": [{"index": 0, "delta": {"content": f"t{i}"}, "finish_reason": "length" if last else None}]
    }
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


@dataclass
class FakeUpstream:
    """mode: "ok", "fail" (500 before any byte), "break" (two events, then the connection drops),
    "halfway" (half an event, then the connection drops), "stop" (two events, then a clean
    end without `data: [DONE]`), "refuse" (`refusal_status`, with `refusal_body`,
    `refusal_type` and a Retry-After of `retry_after`), "no_usage" (a non-streaming reply
    without `usage`) or "not_sse" (a stream of text and HTML under text/event-stream).
    A reply (a stream's status and first event too) comes after `reply_after_s` and once
    `hold` (when given) is set, or never if its client goes first (counted in `num_clients_gone`)."""

    mode: str = "ok"
    num_events: int = 4
    event_gap_s: float = 0.0
    reply_after_s: float = 0.0
    first_event_after_s: float = 0.0  # a stream's headers go out at once, its first event after this
    end_after_done_s: float = 0.0  # a stream ends this long after its `data: [DONE]`
    one_write: bool = False  # a stream's events and `data: [DONE]` in one write (they may come so)
    refusal_status: int = 429
    refusal_body: bytes = b'{"detail": "slow down"}'
    refusal_type: str = "application/json"
    retry_after: str = "7"
    location: str | None = None  # set: the refusal carries this Location (a redirect, with a 3xx)
    num_clients_gone: int = 0
    api_key: str | None = None  # set: every route answers 401 without `Authorization: Bearer <it>`
    model: str = FAKE_MODEL  # the one model its /v1/models lists
    max_model_len: int | None = None  # set: its model card says so, as vLLM's and tierserve's do
    hold: threading.Event | None = None
    fail_on: str | None = None  # set: a request whose body mentions it gets a 500, whatever the mode
    # A request whose body mentions `slow_on` replies after `slow_reply_after_s` (not held by `hold`).
    slow_on: str | None = None
    slow_reply_after_s: float = 0.0
    # "ok"; "error": its /metrics answers 500; "silent": it answers nothing for 30 s (a
    # stopped process); "draining": its /ready answers 503 as a draining tierserve's does
    checks: str = "ok"
    bodies: list[dict[str, object]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    tiers: list[list[str]] = field(default_factory=list)  # each request's x-request-tier, every one sent

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        self.tiers.append(request.headers.getlist("x-request-tier"))
        if self.mode == "fail" or (self.fail_on is not None and self.fail_on in json.dumps(body)):
            await asyncio.sleep(self.reply_after_s)  # a slow failure, with `reply_after_s`
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        if self.mode == "refuse":
            headers = {"Retry-After": self.retry_after}
            if self.location is not None:
                headers["Location"] = self.location
            return Response(self.refusal_body, self.refusal_status, headers, media_type=self.refusal_type)
        slow = self.slow_on is not None and self.slow_on in json.dumps(body)
        if not await self._client_stays(request, slow):
            self.num_clients_gone += 1
            return Response(status_code=499)
        if not body.get("stream"):
            usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
            reply = {"choices": [{"message": {"content": "ok"}}], "usage": usage}
            if self.mode == "no_usage":
                del reply["usage"]
            return JSONResponse(reply)
        if self.mode == "not_sse":
            page = [b"this is not sse at all\n\n", b"<html><body>oops</body></html>\n\n"]
            return StreamingResponse(iter(page), media_type="text/event-stream")
        return StreamingResponse(self._stream(), media_type="text/event-stream")

    async def _client_stays(self, request: Request, slow: bool = False) -> bool:
        """Whether the client is still there after `reply_after_s` (and `hold`, bounded at 60 s),
        or `slow_reply_after_s` for a `slow` request."""
        deadline = time.monotonic() + (self.slow_reply_after_s if slow else self.reply_after_s)
        hold = None if slow else self.hold
        held_until = deadline + (60.0 if hold is not None else 0.0)
        while time.monotonic() < deadline or (
            hold is not None and not hold.is_set() and time.monotonic() < held_until
        ):
            if await request.is_disconnected():
                return False
            await asyncio.sleep(0.02)
        return True

    async def _stream(self) -> AsyncIterator[bytes]:
        if self.one_write and self.mode == "ok":
            yield (
                b"".join(_event(i, i == self.num_events - 1) for i in range(self.num_events))
                + b"data: [DONE]\n\n"
            )
            await asyncio.sleep(self.end_after_done_s)
            return
        await asyncio.sleep(self.first_event_after_s)
        if self.mode == "halfway":
            yield _event(0, False)[:20]
            await asyncio.sleep(0.05)  # sent on its own, before the connection drops
            raise ConnectionError("the upstream died inside its first event")
        for i in range(self.num_events):
            if self.mode == "break" and i == 2:
                raise ConnectionError("the upstream died mid-stream")
            if self.mode == "stop" and i == 2:
                return
            yield _event(i, i == self.num_events - 1)
            await asyncio.sleep(self.event_gap_s)
        yield b"data: [DONE]\n\n"
        await asyncio.sleep(self.end_after_done_s)

    def app(self) -> Any:
        async def metrics(request: Request) -> Response:
            if self.checks == "silent":
                for _ in range(1500):  # 30 s at most, unless the gateway gives up first
                    if await request.is_disconnected():
                        break
                    await asyncio.sleep(0.02)
            return PlainTextResponse(METRICS, status_code=500 if self.checks == "error" else 200)

        async def models(_: Request) -> Response:
            card: dict[str, object] = {"id": self.model, "object": "model"}
            if self.max_model_len is not None:
                card["max_model_len"] = self.max_model_len
            return JSONResponse({"object": "list", "data": [card]})

        async def ready(_: Request) -> Response:  # asked of an upstream of kind "tierserve"
            if self.checks == "draining":
                return JSONResponse({"status": "not ready", "reason": "draining"}, status_code=503)
            return JSONResponse({"status": "ready"})

        app = Starlette(
            routes=[
                Route("/metrics", metrics),
                Route("/v1/models", models),
                Route("/ready", ready),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.chat, methods=["POST"]),
            ]
        )
        key = self.api_key
        if key is None:
            return app

        async def wants_key(scope: Any, receive: Any, send: Any) -> None:
            headers = dict(scope.get("headers") or [])
            if scope["type"] == "http" and headers.get(b"authorization") != f"Bearer {key}".encode():
                refusal = JSONResponse({"error": {"message": "Unauthorized"}}, status_code=401)
                await refusal(scope, receive, send)
                return
            await app(scope, receive, send)

        return wants_key


@dataclass
class Running:
    url: str
    server: uvicorn.Server


@contextmanager
def serve_thread(server_factory: type[uvicorn.Server] | None, app: object, **kw: object) -> Iterator[Running]:
    sock = loopback_socket()
    config = uvicorn.Config(app, log_level="critical", access_log=False, lifespan="on")  # type: ignore[arg-type]
    server = server_factory(config, **kw) if server_factory else uvicorn.Server(config)  # type: ignore[arg-type]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            raise RuntimeError("server did not start")
        time.sleep(0.01)
    try:
        yield Running(f"http://127.0.0.1:{sock.getsockname()[1]}", server)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@contextmanager
def fake_upstream(fake: FakeUpstream) -> Iterator[str]:
    with serve_thread(None, fake.app()) as running:
        yield running.url


@contextmanager
def gateway(
    upstream_urls: list[str], extra: str = "", drain_timeout_s: float = 10.0, kind: str = "vllm"
) -> Iterator[tuple[Running, GatewayState]]:
    import tomllib

    ups = "".join(
        f'\n[[upstreams]]\nname = "f{i}"\nkind = "{kind}"\nurl = "{u}"\n' for i, u in enumerate(upstream_urls)
    )
    config = parse_gateway_config(tomllib.loads(f"[gateway]\nscrape_interval_s = 0.2\n{extra}\n{ups}"))
    fresh = "metrics_max_age_s" not in extra
    with gateway_of(config, drain_timeout_s, fresh_metrics=fresh) as running:
        yield running


@contextmanager
def gateway_of(
    config: GatewayConfig, drain_timeout_s: float = 10.0, *, fresh_metrics: bool = True
) -> Iterator[tuple[Running, GatewayState]]:
    """With `fresh_metrics` each /metrics scrape is made anew (`metrics_max_age_s` 0): tests
    read counts right after the requests that moved them."""
    if fresh_metrics:
        server = dataclasses.replace(config.serve.server, metrics_max_age_s=0.0)
        config = dataclasses.replace(config, serve=dataclasses.replace(config.serve, server=server))
    gw = build_gateway_state(config)
    with serve_thread(
        DrainingGateway, create_gateway_app(gw), gw=gw, drain_timeout_s=drain_timeout_s
    ) as running:
        yield running, gw


@contextmanager
def gateway_over(*fakes: FakeUpstream, extra: str = "", kind: str = "vllm") -> Iterator[Running]:
    """A gateway in front of `fakes`, each served on its own port (upstreams f0, f1, ...)."""
    with ExitStack() as stack:
        urls = [stack.enter_context(fake_upstream(fake)) for fake in fakes]
        running, _ = stack.enter_context(gateway(urls, extra, kind=kind))
        yield running


def spread_body(base: dict[str, Any], i: int, **fields: object) -> dict[str, Any]:
    """`base` with a prompt of its own (`prefix i`), so that prefix affinity spreads requests."""
    return {**base, "messages": [{"role": "user", "content": f"prefix {i}"}], **fields}


def metric_counts(metrics: str, family: str, label: str) -> dict[str, float]:
    """Counter `family`'s samples in a /metrics text, summed by `label` (over its other labels);
    the labels counted 0 (series the gateway starts at 0) left out."""
    out: dict[str, float] = {}
    for f in text_string_to_metric_families(metrics):
        for sample in f.samples:
            if sample.name == family + "_total" and sample.value:
                key = sample.labels[label]
                out[key] = out.get(key, 0.0) + sample.value
    return out
