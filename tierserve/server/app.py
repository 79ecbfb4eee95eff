"""The FastAPI application: OpenAI-compatible routes, health, readiness and metrics.

Every error leaves in OpenAI's envelope; validation errors are 400s naming the field
(FastAPI's default would be 422). An unexpected exception is logged and answered with a
500 in the same envelope; tests assert that no input reaches that handler. A path with a
trailing slash is an unknown path (404), not a redirect: Starlette would answer 307 with
a Location built from the client's Host header. HEAD is answered as GET without the body
(load balancers probe /health and /ready with it).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tierserve import __version__
from tierserve.server.body_limit import BodyLimitMiddleware
from tierserve.server.errors import ApiError, http_error, invalid_body
from tierserve.server.fast_routes import GenerationRoutes, aborted_upload, refused_at_the_door
from tierserve.server.generate import generate
from tierserve.server.metrics_cache import ExpositionCache
from tierserve.server.prepare import check_model
from tierserve.server.protocol import ChatCompletionRequest, CompletionRequest
from tierserve.server.ratelimit import redis_where
from tierserve.server.state import ServerState
from tierserve.server.tracing import ReceivedAtMiddleware

log = logging.getLogger("tierserve.server")

# The tier and tenant headers that `generate` reads from the request, for the OpenAPI
# schema of the two generation routes (served by `GenerationRoutes`, fast_routes.py).
_HEADERS_DOC: dict[str, Any] = {
    "parameters": [
        {
            "name": "x-request-tier",
            "in": "header",
            "required": False,
            "schema": {"type": "string"},
            "description": "realtime|online|batch|background or P0..P3",
        },
        {
            "name": "x-tenant-id",
            "in": "header",
            "required": False,
            "schema": {"type": "string"},
            "description": "tenant, where the config allows it",
        },
    ]
}


def create_app(state: ServerState, *, freeze_heap: bool = False) -> FastAPI:
    """`freeze_heap`: once started, move every live object out of the cyclic collector's
    reach (`gc.freeze`) — modules, the model, the block pool. For a server process: a full
    collection that walks them all pauses every thread (~0.1 s measured under load)."""
    app = FastAPI(
        title="tierserve",
        version=__version__,
        lifespan=_lifespan(state, freeze_heap),
        description="OpenAI-compatible API with priority tiers, tenants and rate limits.",
        redirect_slashes=False,
        **state.config.api_docs_urls(),  # no key guards them: off where keys are required
    )
    app.state.tierserve = state
    app.add_middleware(GenerationRoutes, state=state)  # innermost: inside the body limit
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=state.config.server.max_body_bytes,
        max_buffered_bytes=state.config.server.max_buffered_body_bytes,
        count=state.metrics.count_http_error,
    )
    app.add_middleware(HeadAsGet)
    if state.trace is not None:
        app.add_middleware(ReceivedAtMiddleware)  # outermost: added last
    _add_error_handlers(app, state)
    _add_routes(app, state)
    return app


class HeadAsGet:
    """HEAD answered as GET, with GET's headers (Content-Length included) and no body: FastAPI
    routes take only the methods they declare, so every GET route would answer HEAD with 405."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self._app(scope, receive, send)
            return

        async def without_body(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self._app({**scope, "method": "GET"}, receive, without_body)


def _lifespan(
    state: ServerState, freeze_heap: bool
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Start the engine (and freeze the heap) before serving; drain and close after."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        rl = state.config.server.ratelimit
        await state.limiter.check_remote(redis_where(rl.redis_url), max(rl.redis_timeout_s, 1.0))
        if freeze_heap:
            gc.collect()
            gc.freeze()
        log.info("tierserve ready: %s", state.describe())
        try:
            yield
        finally:
            state.begin_draining()
            await state.engine.stop()
            await state.body_parser.aclose()
            if state.remote_buckets is not None:
                await state.remote_buckets.close()

    return lifespan


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    """Every error as the API's JSON error body; an aborted upload counted, not a 500."""

    @app.exception_handler(ApiError)
    async def api_error(_: HttpRequest, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: HttpRequest, exc: RequestValidationError) -> Response:
        return invalid_body(exc.errors()).response()

    @app.exception_handler(HTTPException)
    async def starlette_error(_: HttpRequest, exc: HTTPException) -> Response:
        return refused_at_the_door(http_error(exc), state.metrics.count_http_error)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(http: HttpRequest, _: ClientDisconnect) -> Response:
        aborted_upload(state.metrics.count_http_error, http.scope, log)
        return Response(status_code=499)  # never sent: the client is gone

    @app.exception_handler(Exception)
    async def internal_error(_: HttpRequest, exc: Exception) -> Response:
        log.exception("unhandled error")
        return ApiError(500, "Internal server error.", type="server_error").response()


def _add_routes(app: FastAPI, state: ServerState) -> None:
    # Served by `GenerationRoutes` ahead of FastAPI's router; declared here for the schema.
    @app.post("/v1/chat/completions", response_model=None, openapi_extra=_HEADERS_DOC)
    async def chat_completions(body: ChatCompletionRequest, http: HttpRequest) -> Response:
        return await generate(state, http, body)

    @app.post("/v1/completions", response_model=None, openapi_extra=_HEADERS_DOC)
    async def completions(body: CompletionRequest, http: HttpRequest) -> Response:
        return await generate(state, http, body)

    def model_card() -> dict[str, Any]:
        m = state.model
        return {
            "id": m.name,
            "object": "model",
            "created": m.created,
            "owned_by": "tierserve",
            "max_model_len": m.max_model_len,
        }

    @app.get("/v1/models")
    async def models(http: HttpRequest) -> dict[str, Any]:
        # Behind the same keys as generation (with keys configured: 401 without a known one).
        state.tenants.resolve_headers(http.headers)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, http: HttpRequest) -> dict[str, Any]:
        """One model (the OpenAI client's `models.retrieve`), behind the same keys."""
        state.tenants.resolve_headers(http.headers)
        check_model(state, model_id)
        return model_card()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        why = state.not_ready()
        if why is None:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready", "reason": why}, status_code=503)

    async def exposition() -> bytes:
        families = await state.engine.metric_families()  # the engine process's, if it has its own
        return state.metrics.render(families)

    cached = ExpositionCache(exposition, state.config.server.metrics_max_age_s, state.clock.now)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await cached.get(), media_type=CONTENT_TYPE_LATEST)
