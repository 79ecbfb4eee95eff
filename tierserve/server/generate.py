"""One generation request, from the HTTP body to the last byte.

Order of checks: draining (503) -> tenant (401) -> the request buckets (429, charged
before the body was read: `charge_request`) -> model and body (404/400) -> tier -> token
buckets (429; 400 for a request too large to ever fit) -> admission (503) -> draining
again (it may have begun while the prompt was prepared off the event loop, or the buckets
answered: past that point the drain would not wait for it) -> engine. No tokens are
reserved until the body is known to be valid, and a refusal after the token buckets
refunds the reserved tokens; the request's charge stays.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import Response

from tierserve.detokenize import TextStream
from tierserve.request import FinishReason, Request
from tierserve.server.body_gate import BodyGate
from tierserve.server.config import TenantConfig
from tierserve.server.errors import ApiError
from tierserve.server.formatting import DONE, ResponseFormatter, Usage, error_event
from tierserve.server.prepare import Prepared, check_model, prepare
from tierserve.server.protocol import ChatCompletionRequest, CompletionRequest
from tierserve.server.ratelimit import RateDecision, Reservation
from tierserve.server.refusals import draining_error, overloaded, rate_refusal
from tierserve.server.sse import SSEResponse, watch_disconnect
from tierserve.server.state import ServerState
from tierserve.server.streams import Delta, RequestHandle
from tierserve.server.tenants import decide_tier, parse_declared_tier, tier_header
from tierserve.server.tracing import RECEIVED_AT, TraceRecord
from tierserve.tiers import Tier


async def generate(
    state: ServerState,
    http: HttpRequest,
    body: ChatCompletionRequest | CompletionRequest,
    tenant: TenantConfig | None = None,
    charged: RateDecision | None = None,
    *,
    offload: BodyGate | None = None,
) -> Response:
    """Serve one generation; the tier comes from `x-request-tier` or the body's `priority`, the
    tenant from the API key or `x-tenant-id` (resolved here unless the caller did).
    `charged`: the request buckets' decision, taken before the body was read (None: they
    are charged here, with the tokens). `offload`: tokenize and check a large prompt
    through this gate, off the event loop."""
    chat = isinstance(body, ChatCompletionRequest)
    tenant = _refuse_early(state, http, body, tenant)
    decision = decide_tier(tenant, parse_declared_tier(tier_header(http.headers), body.priority))
    tier = decision.effective
    if offload is None:
        prepared = prepare(state, body, tier)
    else:
        prepared = await offload.run_for(tenant.name, prepare, state, body, tier)
    max_tokens = prepared.sampling.max_tokens
    num_reserved = len(prepared.prompt_token_ids) + max_tokens
    num_default, param = body.reserved_output(max_tokens)
    rate, headers = await _pass_limits(state, tenant, tier, num_reserved, num_default, param, charged=charged)
    request_id = state.new_request_id("chatcmpl" if chat else "cmpl")
    req = Request(
        request_id,
        prepared.prompt_token_ids,
        prepared.sampling,
        tier=tier,
        tenant=tenant.name,
        tenant_weight=tenant.weight,
        arrival_time=state.clock.now(),
        cache_salt=state.tenants.cache_salt(tenant, body.cache_salt),
    )
    handle = state.engine.submit(req, decision.entitled)
    fmt = ResponseFormatter(
        chat=chat,
        response_id=request_id,
        created=int(time.time()),
        model=state.model.name,
        include_usage=prepared.include_usage,
        continuous_usage=prepared.continuous_usage,
    )
    run = GenerationRun(state, handle, fmt, prepared, rate.reservation)
    if state.trace is not None:
        received = http.scope.get(RECEIVED_AT)
        run.trace = state.trace.records[request_id] = TraceRecord(received if received else time.monotonic())
    if prepared.stream:
        return SSEResponse(run.stream(), headers, on_disconnect=run.cancel)
    watcher = watch_disconnect(http.receive, run.cancel)
    try:
        result = await run.collect()
    finally:
        watcher.cancel()
    return Response(json.dumps(result), headers=headers, media_type="application/json")


def _refuse_early(
    state: ServerState,
    http: HttpRequest,
    body: ChatCompletionRequest | CompletionRequest,
    tenant: TenantConfig | None,
) -> TenantConfig:
    """The refusals before any work on the prompt: draining (503), the tenant (401, unless
    the caller resolved it) and the model (404). Returns the tenant."""
    if state.draining:
        state.metrics.reject("draining", None)
        raise draining_error()
    if tenant is None:
        tenant = state.tenants.resolve_headers(http.headers)
    check_model(state, body.model)
    return tenant


async def _pass_limits(
    state: ServerState,
    tenant: TenantConfig,
    tier: Tier,
    num_reserved: int,
    num_default: int,
    param: str,
    *,
    charged: RateDecision | None,
) -> tuple[RateDecision, dict[str, str]]:
    """The tenant's token buckets, then admission control for the tier; raises the 429 or
    503 (giving back the reserved tokens) when either refuses, or the 400 naming `param` for
    a request no bucket can ever hold. `num_default`: the output tokens of `num_reserved`
    that the server chose (`RateLimiter.acquire`). `charged`: the request buckets' decision,
    where they were charged before the body was read. Returns the rate decision and the
    headers every answer carries."""
    metrics = state.metrics
    rate = await state.limiter.acquire(tenant, num_reserved, num_default=num_default, charged=charged)
    headers = {"x-tierserve-tier": tier.name, **rate.headers}
    if not rate.allowed:
        metrics.reject(f"rate_limit_{rate.reason}", tier)
        raise rate_refusal(rate, tenant.name, headers, param=param)
    engine = state.engine
    verdict = state.admission.check(
        tier, engine.queued_by_tier(), state.clock.now(), engine.waiting_by_tier()
    )
    if not verdict.admitted:
        metrics.reject(verdict.reason, tier)
        await state.limiter.settle(rate.reservation, 0)
        wait = verdict.estimated_wait_s
        raise overloaded(tier, verdict.reason, verdict.retry_after_s, verdict.queue_depth, wait, headers)
    if state.draining:  # it began while the prompt was prepared or the buckets answered
        metrics.reject("draining", tier)
        await state.limiter.settle(rate.reservation, 0)
        raise draining_error()
    return rate, headers


class GenerationRun:
    """Turns the engine's deltas into text, stops at stop strings, and settles at the end."""

    def __init__(
        self,
        state: ServerState,
        handle: RequestHandle,
        fmt: ResponseFormatter,
        prepared: Prepared,
        reservation: Reservation | None,
    ) -> None:
        self._state = state
        self._handle = handle
        self._fmt = fmt
        self._prepared = prepared
        self._reservation = reservation
        self._text = TextStream(state.tokenizer, prepared.stop, prepared.prompt_token_ids)
        self._num_received = 0
        self._num_counted = 0  # of the tokens used, those counted in `vllm:generation_tokens`
        self._cached = 0
        self._closed = False
        self.trace: TraceRecord | None = None

    def cancel(self) -> None:
        """The client went away."""
        if not self._closed and not self._handle.finished:
            self._state.metrics.disconnects.inc()
            self._state.engine.cancel(self._handle)

    @property
    def _usage(self) -> Usage:
        used = self._text.num_tokens_used if self._text.stopped else self._num_received
        return Usage(len(self._prepared.prompt_token_ids), used, self._cached)

    def _consume(self, deltas: list[Delta]) -> tuple[str, str | None, Delta | None]:
        """Text to send, the finish reason if it ended, and the final delta if it failed."""
        end = next((d for d in deltas if d.finished), None)
        if end is not None:
            deltas = deltas[: deltas.index(end) + 1]  # nothing follows an end
        ids = [t for d in deltas for t in d.token_ids]
        self._num_received += len(ids)
        self._cached = max(self._cached, *(d.num_cached_tokens for d in deltas))
        text = self._text.push(ids)
        self._count_generated()
        if self._text.stopped:
            if end is None:
                self._state.engine.finish(self._handle.request.request_id)
            return text, "stop", None
        if end is None:
            return text, None, None
        if end.error or end.finish_reason in (FinishReason.ABORTED, FinishReason.REJECTED, FinishReason.SHED):
            return text, None, end
        text += self._text.flush()  # a stop string may complete only now
        stopped = self._text.stopped or end.finish_reason is not FinishReason.LENGTH
        return text, ("stop" if stopped else "length"), None

    def _count_generated(self) -> None:
        """`vllm:generation_tokens` counts what the usage counts, as it comes: up to the stop
        string's last token, not the tokens the engine made before the server's `finish`
        reached it (1-3 at a 2 ms step), which no client is sent or charged for. vLLM's
        frontend drops those too, before its statistics."""
        used = self._text.num_tokens_used
        if used > self._num_counted:
            self._state.metrics.count_generated(used - self._num_counted)
            self._num_counted = used

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._state.engine.close(self._handle)
        if self._reservation is not None:
            used = len(self._prepared.prompt_token_ids) + self._usage.completion_tokens
            self._state.spawn(self._state.limiter.settle(self._reservation, used))

    async def stream(self) -> AsyncIterator[bytes]:
        fmt = self._fmt
        started = False
        try:
            while True:
                text, reason, failed = self._consume(await self._handle.next())
                out: list[bytes] = []
                if failed is not None:
                    if not started:
                        raise _failure(failed)
                    yield self._cut_tail(text, failed)
                    return
                first = not started
                usage = self._usage if fmt.continuous_usage else None
                if first:
                    started = True
                    # The role comes before any token, as vLLM counts it.
                    out.append(fmt.first_chunk(usage and replace(usage, completion_tokens=0)))
                if text:
                    out.append(fmt.text_chunk(text, usage))
                if reason is not None:
                    out.append(fmt.finish_chunk(reason, usage))
                    if fmt.include_usage:
                        out.append(fmt.usage_chunk(self._usage))
                    out.append(DONE)
                chunk = b"".join(out)
                if not chunk and not first:
                    continue  # tokens with no text yet (an incomplete character, a held stop prefix)
                # The first one goes out even if empty: it carries the status line. It is
                # made when the engine accepts the request (an empty delta), before any token.
                yield chunk
                if self.trace is not None and self.trace.first_sent_at is None and self._num_received:
                    self.trace.first_sent_at = time.monotonic()  # resumed: the chunk has been sent
                if reason is not None:
                    return
        finally:
            self._close()

    def _cut_tail(self, text: str, failed: Delta) -> bytes:
        """How a stream the engine ended early (a drain's deadline, the engine stopping) ends:
        the text it had, the usage so far where the client asked for usage, then the error
        event. The usage comes before the error because clients stop reading at the error
        (OpenAI's raises there); without it a gateway metering the stream would charge the
        whole reservation for tokens never generated."""
        fmt = self._fmt
        usage = self._usage if fmt.continuous_usage else None
        out = [fmt.text_chunk(text, usage)] if text else []
        if fmt.include_usage:
            out.append(fmt.usage_chunk(self._usage))
        out.append(error_event(failed.error or "request aborted", code="aborted") + DONE)
        return b"".join(out)

    async def collect(self) -> dict[str, Any]:
        parts: list[str] = []
        try:
            while True:
                text, reason, failed = self._consume(await self._handle.next())
                if failed is not None:
                    raise _failure(failed)
                parts.append(text)
                if reason is not None:
                    return self._fmt.full("".join(parts), reason, self._usage)
        finally:
            self._close()


def _failure(end: Delta) -> ApiError:
    if end.finish_reason is FinishReason.REJECTED:
        return ApiError(400, f"The engine refused the request: {end.error}", param="max_tokens")
    if end.finish_reason is FinishReason.SHED:
        return ApiError(
            503,
            f"The request was shed under overload: {end.error}",
            type="server_error",
            code="shed",
            headers={"Retry-After": "30"},
            extra={"retry_after": 30.0},
        )
    return ApiError(
        503,
        f"The request was aborted: {end.error}." if end.error else "The request was aborted.",
        type="server_error",
        code="aborted",
        headers={"Retry-After": "1"},
        extra={"retry_after": 1.0},
    )
