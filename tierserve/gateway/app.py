"""The gateway's FastAPI application: the OpenAI-compatible routes of `tierserve serve`,
forwarded to upstream replicas, plus health, readiness and metrics.

Errors leave in OpenAI's envelope, through the server's own handlers and body limit. As
in the server (server/app.py): a path with a trailing slash is an unknown path (404), not a
redirect built from the client's Host header, and HEAD is answered as GET without the body.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from tierserve import __version__
from tierserve.gateway.forward import forward
from tierserve.gateway.poller import UpstreamPoller
from tierserve.gateway.router import UpstreamState
from tierserve.gateway.state import GatewayState
from tierserve.server.app import HeadAsGet
from tierserve.server.body_limit import BodyLimitMiddleware
from tierserve.server.errors import ApiError, http_error, quoted
from tierserve.server.fast_routes import aborted_upload, refused_at_the_door
from tierserve.server.metrics_cache import ExpositionCache
from tierserve.server.ratelimit import redis_where

log = logging.getLogger("tierserve.gateway")


CHAT_BY_PATH = {"/v1/chat/completions": True, "/v1/completions": False}


class GenerationRoutes:
    """The two generation routes, answered ahead of FastAPI's router as `tierserve serve`
    answers them (server/fast_routes.py): its routing and exception layers cost about
    0.2 ms a request and wrap every chunk of every stream. The FastAPI routes stay declared
    for the schema."""

    def __init__(self, app: ASGIApp, gw: GatewayState) -> None:
        self._app = app
        self._gw = gw

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrived = time.perf_counter()  # for the gateway's added-latency metric
        chat = CHAT_BY_PATH.get(scope["path"]) if scope["type"] == "http" else None
        if chat is None or scope["method"] != "POST":
            await self._app(scope, receive, send)  # other methods get FastAPI's 405
            return
        try:
            response = await forward(self._gw, HttpRequest(scope, receive), chat, arrived)
        except ApiError as e:
            response = e.response()
        except HTTPException as e:  # the body limit, while reading a chunked body
            response = refused_at_the_door(http_error(e), self._gw.metrics.count_http_error)
        except ClientDisconnect:
            aborted_upload(self._gw.metrics.count_http_error, scope, log)
            return
        await response(scope, receive, send)


def _lifespan(gw: GatewayState) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Open the upstream session and poll the upstreams once before serving; poll on a
    timer while serving; close everything on the way out."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        gw.open_streams()
        poller = UpstreamPoller(gw)
        await asyncio.gather(poller.poll_once(), _check_redis(gw))  # know both before the first request
        task = asyncio.get_running_loop().create_task(poller.run())
        healthy = [s.name for s in gw.router.states if s.healthy]
        total = len(gw.router.states)
        if healthy:
            log.info("tierserve gateway ready: %d/%d upstreams healthy", len(healthy), total)
        else:  # /ready answers 503 until a health check admits one
            log.warning("tierserve gateway started, not ready: 0/%d upstreams healthy yet", total)
        try:
            yield
        finally:
            gw.begin_draining()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await gw.close_clients()
            if gw.remote_buckets is not None:
                await gw.remote_buckets.close()

    return lifespan


async def _check_redis(gw: GatewayState) -> None:
    """Ask the limits' Redis once at start-up (`RateLimiter.check_remote`): the gateway still
    serves if it does not answer, each tier by its `[gateway.redis_fail]` rule."""
    rl = gw.config.serve.server.ratelimit
    timeout_s = max(rl.redis_timeout_s, gw.config.gateway.connect_timeout_s)
    await gw.limiter.check_remote(redis_where(rl.redis_url), timeout_s)


def create_gateway_app(gw: GatewayState) -> FastAPI:
    app = FastAPI(
        title="tierserve gateway",
        version=__version__,
        lifespan=_lifespan(gw),
        redirect_slashes=False,
        **gw.config.serve.api_docs_urls(),  # no key guards them: off where keys are required
    )
    app.state.gateway = gw
    app.add_middleware(GenerationRoutes, gw=gw)  # innermost: inside the body limit
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=gw.config.serve.server.max_body_bytes,
        max_buffered_bytes=gw.config.serve.server.max_buffered_body_bytes,
        count=gw.metrics.count_http_error,
    )
    app.add_middleware(HeadAsGet)
    _add_error_handlers(app, gw)
    _add_routes(app, gw)
    return app


def _add_error_handlers(app: FastAPI, gw: GatewayState) -> None:
    """Every error leaves in OpenAI's envelope; anything unexpected as a logged 500."""

    @app.exception_handler(ApiError)
    async def api_error(_: HttpRequest, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(HTTPException)
    async def starlette_error(_: HttpRequest, exc: HTTPException) -> Response:
        return refused_at_the_door(http_error(exc), gw.metrics.count_http_error)

    @app.exception_handler(Exception)
    async def internal_error(_: HttpRequest, exc: Exception) -> Response:
        log.exception("unhandled error")
        return ApiError(500, "Internal server error.", type="server_error").response()


def _model_cards(gw: GatewayState) -> dict[str, dict[str, Any]]:
    """The models the healthy upstreams serve, each with the context a request may use on
    all of them (`max_model_len`, as vLLM's and tierserve's cards give it: the least of
    theirs; left out where one of them does not say). Which upstreams serve a model is not
    said: their names are often their addresses, which the gateway's 502s keep from clients
    too (any valid key read them here)."""
    served: dict[str, list[UpstreamState]] = {}
    for s in gw.router.states:
        if s.healthy:
            for m in s.models:
                served.setdefault(m, []).append(s)
    cards: dict[str, dict[str, Any]] = {}
    for m, ups in sorted(served.items()):
        cards[m] = {
            "id": m,
            "object": "model",
            "created": gw.started_at,  # OpenAI's Model object requires it: when this gateway started
            "owned_by": "tierserve-gateway",
        }
        lengths = [s.max_model_len.get(m) for s in ups]
        if lengths and None not in lengths:
            cards[m]["max_model_len"] = min(n for n in lengths if n is not None)
    return cards


def _add_routes(app: FastAPI, gw: GatewayState) -> None:
    # Served by `GenerationRoutes` ahead of FastAPI's router; declared here for the schema.
    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(http: HttpRequest) -> Response:
        return await forward(gw, http, True, time.perf_counter())

    @app.post("/v1/completions", response_model=None)
    async def completions(http: HttpRequest) -> Response:
        return await forward(gw, http, False, time.perf_counter())

    @app.get("/v1/models")
    async def models(http: HttpRequest) -> dict[str, Any]:
        gw.tenants.resolve_headers(http.headers)
        return {"object": "list", "data": list(_model_cards(gw).values())}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, http: HttpRequest) -> dict[str, Any]:
        """One model (the OpenAI client's `models.retrieve`), behind the same keys, as the server."""
        gw.tenants.resolve_headers(http.headers)
        cards = _model_cards(gw)
        card = cards.get(model_id)
        if card is None:
            raise ApiError(
                404,
                f"The model {quoted(model_id)} does not exist (served here: {', '.join(cards) or 'none'}).",
                param="model",
                code="model_not_found",
            )
        return card

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        if gw.draining:
            return JSONResponse({"status": "not ready", "reason": "draining"}, status_code=503)
        if not any(s.healthy for s in gw.router.states):
            return JSONResponse({"status": "not ready", "reason": "no healthy upstream"}, status_code=503)
        return JSONResponse({"status": "ready"})

    async def exposition() -> bytes:
        return gw.metrics.render()

    # No key guards it, and each render is milliseconds on the loop that relays the streams.
    cached = ExpositionCache(exposition, gw.config.serve.server.metrics_max_age_s, gw.clock.now)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await cached.get(), media_type=CONTENT_TYPE_LATEST)
