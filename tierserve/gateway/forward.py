"""One generation request through the gateway, from the HTTP body to the last byte.

Order of checks, as in `tierserve serve`: draining (503) -> tenant (401, before the body
is read) -> Content-Type, Content-Encoding (415, unread) -> one request from the global
and the tenant's request buckets (429, the body unread; the charge stays whatever the
answer) -> body (400; 503 past `large_body_queue` large bodies, 429 past
`large_body_queue_per_tenant` of the tenant's) -> model (404) -> tier (400 for a tier
header sent twice, differing, or a tier whose queue cap is 0) -> token buckets and the
tier's (429, or 503 when Redis is down and the tier fails closed; 400 for a request too
large to ever fit) -> flow control (503) -> upstream. An upstream that fails before the
first byte of its reply reaches the client (connect error, 5xx, a stream cut before its
first whole event) is left for another one, up to `max_attempts`; once bytes have
reached the client a broken stream ends with an error event. A request the upstream took
and left unanswered past the read timeout fails alone (504, `_timed_out`). Reserved tokens
are settled with the upstream's reported usage.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import aiohttp
from starlette.requests import Request as HttpRequest
from starlette.responses import Response

from tierserve.gateway.body import ForwardBody, Refused, Summary, read_body
from tierserve.gateway.priority import pass_down
from tierserve.gateway.relay import Relay
from tierserve.gateway.router import RouteDecision
from tierserve.gateway.state import GatewayState
from tierserve.gateway.usage import EventTooLarge, ReplyRead, SseUsageTap, read_reply
from tierserve.server.body_parser import Kind
from tierserve.server.config import TenantConfig
from tierserve.server.errors import ApiError, invalid_body
from tierserve.server.fast_routes import (
    OFFLOAD_BYTES,
    close_if_unread,
    refused_at_the_door,
    unsupported_body,
)
from tierserve.server.ratelimit import Reservation
from tierserve.server.refusals import charge_request, draining_error, queue_closed, rate_refusal
from tierserve.server.sse import SSEResponse, watch_disconnect
from tierserve.server.tenants import decide_tier, parse_declared_tier, tier_header
from tierserve.tiers import Tier

log = logging.getLogger("tierserve.gateway")
RETRYABLE_STATUS = frozenset({500, 502, 503, 504})
MAX_REPLY_BYTES = 64 << 20  # a non-streaming reply, read whole before it is passed on
REPLY_OFFLOAD_BYTES = 256 << 10  # a reply larger is parsed in the body parser's process
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request whose client went away


@dataclass
class _Call:
    """What one request carries through its attempts."""

    path: str
    body: ForwardBody
    stream: bool
    tier: Tier
    tenant: TenantConfig
    reservation: Reservation | None
    headers: dict[str, str]
    arrived: float  # perf_counter() when the request reached the gateway
    # Of the time since: waits in the gateway's queue and attempts on upstreams that failed,
    # which are not the gateway's own work (left out of `tierserve_gateway_added_seconds`).
    not_ours_s: float = 0.0
    queued_s: float = 0.0  # of which in the gateway's queue, over its attempts
    # The route of the attempt under way until its seat goes back (`_give_back`, once) or
    # passes to the stream's Relay.
    seat: RouteDecision | None = None


def _settle(gw: GatewayState, call: _Call, num_tokens_used: int | None) -> None:
    """Settle the request's token reservation with what it used (None: charge it whole),
    once: a refusal passed on from an upstream was settled where it was read and again as
    it left the gateway, refunding its reservation twice (nine refused requests raised a
    tenant's token bucket from 500 to 3,315 tokens)."""
    reservation, call.reservation = call.reservation, None
    if reservation is not None:
        used = reservation.num_tokens if num_tokens_used is None else num_tokens_used
        gw.spawn(gw.limiter.settle(reservation, used))


def _give_back(gw: GatewayState, call: _Call) -> None:
    """The attempt's upstream seat back to the router, once: a second time took another
    request's seat (the router's count stops at 0)."""
    if call.seat is not None:
        gw.dispatcher.finished(call.seat)
        call.seat = None


async def _read_body(
    gw: GatewayState, http: HttpRequest, chat: bool, tenant: str
) -> tuple[ForwardBody, Summary]:
    """The body to forward and what the gateway reads of it (`body.read_body`; a large one
    in the body parser's process, at `tenant`'s turn). A drain that begins while it comes in
    refuses it."""
    content = await gw.uploads.read(http)
    if content is None:
        gw.metrics.reject("draining", None)
        raise draining_error(unread=True)
    kind: Kind = "chat" if chat else "completion"
    job = partial(read_body, prefix_chars=gw.config.gateway.prefix_chars)
    if len(content) > OFFLOAD_BYTES:
        try:
            read = await gw.body_gate.admit(partial(gw.body_parser.run, job, kind, content), tenant)
        except ApiError as e:  # too many waiting: 503 `busy` (429 `busy_tenant`), as the server counts it
            gw.metrics.count_http_error(e.code or "busy")
            raise
    else:
        read = job(kind, content)
    if isinstance(read, Refused):
        if read.errors:
            raise invalid_body(read.errors)
        raise ApiError(400, read.message, code="invalid_json")
    return read


def _check_model(gw: GatewayState, model: str) -> None:
    """A 404 for a model no upstream lists. One listed by upstreams that are all ejected
    right now is left to the dispatcher's 503 `no_upstream`: a client retries that, and
    would not retry a 404 for an outage."""
    states = gw.router.states
    known = {m for s in states for m in s.models}  # an ejected upstream keeps its last list
    if known and model not in known and not any(s.healthy and not s.models for s in states):
        raise ApiError(
            404,
            f"The model {model!r} does not exist (served here: {', '.join(sorted(known))}).",
            param="model",
            code="model_not_found",
        )


async def forward(gw: GatewayState, http: HttpRequest, chat: bool, arrived: float) -> Response:
    """`arrived`: perf_counter() when the request reached the gateway's app."""
    if gw.draining:
        gw.metrics.reject("draining", None)
        raise draining_error()
    asked = http.headers
    try:
        tenant = gw.tenants.resolve_headers(asked)
    except ApiError as e:
        close_if_unread(e, http)
        return refused_at_the_door(e, gw.metrics.count_http_error)
    if (refused := unsupported_body(http)) is not None:
        return refused_at_the_door(refused, gw.metrics.count_http_error)
    try:
        charged = await charge_request(gw.limiter, tenant, gw.metrics.reject)
    except ApiError as e:  # its request buckets are empty: its body is not worth reading
        close_if_unread(e, http)
        raise
    forwarded, body = await _read_body(gw, http, chat, tenant.name)
    _check_model(gw, body.model)
    declared = parse_declared_tier(tier_header(asked), body.priority)
    tier = decide_tier(tenant, declared).effective
    if gw.flow.is_closed(tier):
        raise queue_closed(tier)
    requested = body.requested_max_tokens
    max_tokens = requested if requested is not None else gw.config.serve.server.default_max_tokens
    num_reserved = forwarded.num_prompt_tokens + max_tokens
    num_default, param = body.reserved_output(max_tokens)  # as the server reserves
    rate = await gw.limiter.acquire(tenant, num_reserved, tier, num_default=num_default, charged=charged)
    headers = {"x-tierserve-tier": tier.name, **rate.headers}
    if not rate.allowed:
        gw.metrics.reject(f"rate_limit_{rate.reason}", tier)
        raise rate_refusal(rate, tenant.name, headers, param=param)
    if gw.draining:  # it began while the buckets answered: the drain would not wait for it
        gw.metrics.reject("draining", tier)
        await gw.limiter.settle(rate.reservation, 0)
        raise draining_error()
    call = _Call(
        "/v1/chat/completions" if chat else "/v1/completions",
        forwarded,
        bool(body.stream),
        tier,
        tenant,
        rate.reservation,
        headers,
        arrived,
    )
    gw.num_in_flight += 1
    try:
        response = await _unless_client_leaves(gw, call, http)
    except BaseException:
        gw.num_in_flight -= 1
        _settle(gw, call, 0)
        raise
    if not isinstance(response, SSEResponse):
        gw.num_in_flight -= 1
    return response


async def _unless_client_leaves(gw: GatewayState, call: _Call, http: HttpRequest) -> Response:
    """`_attempts`, given up when the client goes away before the reply (a non-streaming
    one whole, a stream's first bytes: from then on its response watches its client
    itself): the upstream call is dropped, or the request leaves the gateway's queue, so
    the upstream sees the client go too, and the reservation is kept whole, as for a stream
    cut before its usage. Given up too when the gateway's drain times out (`gw.calls`):
    then the client gets a 503 `aborted`, as a stream gets its `aborted` event."""
    attempts = asyncio.ensure_future(_attempts(gw, call))

    def client_left() -> None:
        attempts.cancel()

    watcher = watch_disconnect(http.receive, client_left)
    gw.calls.add(attempts)
    try:
        return await attempts
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # this handler itself is cancelled (the server stops)
        if watcher.done():
            return Response(status_code=CLIENT_CLOSED_REQUEST)  # no one reads it
        raise ApiError(
            503,
            "The gateway is shutting down: its drain ended before this request did.",
            type="server_error",
            code="aborted",
            headers={"Retry-After": "1"},  # another gateway may take it
        ) from None
    finally:
        gw.calls.discard(attempts)
        watcher.cancel()


async def _attempts(gw: GatewayState, call: _Call) -> Response:
    settings = gw.config.gateway
    prefix = call.body.prefix
    tried: list[str] = []
    last_error = "no upstream tried"
    busy: list[float] = []  # the Retry-After of each attempt that said the upstream was full
    # Upstreams that failed this request by answering wrongly: held against them only once
    # another upstream serves it. A request that fails everywhere is taken for the cause (an
    # input an engine cannot take): counted, one such request retried by its client ejected
    # every upstream, and the fleet refused everything for the hold.
    faults: list[tuple[str, str]] = []
    model = call.body.model
    for attempt in range(1, settings.max_attempts + 1):
        decision = await _route(gw, call, model, prefix, tried)
        call.not_ours_s += decision.waited_s
        call.queued_s += decision.waited_s
        call.seat = decision
        tried_at = time.perf_counter()
        try:
            response = await _try_unless_ejected(gw, call, decision)
        except asyncio.CancelledError:  # the client left, or the gateway's drain cut it
            _give_back(gw, call)
            outcome = "cut" if gw.dispatcher.cutting else "client_left"
            gw.metrics.upstream_requests.labels(decision.upstream, outcome).inc()
            raise
        except _Retry as e:
            call.not_ours_s += time.perf_counter() - tried_at
            _give_back(gw, call)
            tried.append(decision.upstream)
            last_error = str(e)
            if e.fault:
                faults.append((decision.upstream, last_error))
            if e.retry_after_s is not None:
                busy.append(e.retry_after_s)
            # A retry is counted only where one follows: the last attempt's failure is the
            # request's refusal, counted below (each one counted as a retry hid them).
            retrying = attempt < settings.max_attempts and bool(gw.router.candidates(model, tried))
            gw.metrics.upstream_requests.labels(decision.upstream, "retried" if retrying else "failed").inc()
            if not retrying:
                log.warning("upstream %s failed before the first byte (%s)", decision.upstream, e)
                break
            gw.metrics.retries.labels(decision.upstream).inc()
            log.warning("upstream %s failed before the first byte (%s); retrying", decision.upstream, e)
        except ApiError:
            raise  # `_whole` gave the seat back and counted the outcome before the refusal
        except Exception:
            # A failure no branch foresaw (a bug): the seat goes back, or the upstream's
            # in-flight count kept it for good (two such requests filled max_in_flight = 2).
            if call.seat is not None:  # else `_whole` counted the outcome already
                gw.metrics.upstream_requests.labels(decision.upstream, "error").inc()
            _give_back(gw, call)
            raise
        else:
            if response.status_code < 400:  # served here (not refused): those failures were theirs
                _hold_against(gw, faults)
            return response
    log.warning("no upstream could serve a request; the last error: %s", last_error)
    refusal = _unserved(call, len(tried), busy)
    gw.metrics.reject(refusal.code or "upstream_unavailable", call.tier)
    raise refusal


async def _route(gw: GatewayState, call: _Call, model: str, prefix: str, tried: list[str]) -> RouteDecision:
    """An upstream for the request's next attempt (one not `tried`), waiting in the
    gateway's queue if every one is full for its tier; a refusal carries the tier and
    rate-limit headers, as the server sends them."""
    try:
        return await gw.dispatcher.acquire(
            call.tier,
            call.tenant.name,
            model,
            prefix,
            num_tokens=call.reservation.num_tokens if call.reservation else 1,
            tenant_weight=call.tenant.weight,
            exclude=tried,
            waited_s=call.queued_s,
        )
    except ApiError as e:
        e.headers = {**call.headers, **e.headers}
        raise


def _hold_against(gw: GatewayState, faults: list[tuple[str, str]]) -> None:
    """Count each (upstream, why) failure toward ejecting its upstream: another served the request."""
    for name, why in faults:
        gw.record_failure(name, f"forwarded requests failed ({why})", forwarded=True)


def _unserved(call: _Call, num_tried: int, busy: list[float]) -> ApiError:
    """The answer when no upstream could take the request. The client hears how many were
    tried, not what failed: the errors name hosts and ports behind the gateway (each failure
    is in the gateway's log, with its upstream)."""
    if num_tried and len(busy) == num_tried:
        # Every upstream tried was full and said when to come back: so does the gateway (a
        # 502 asking for a retry in 1 s had its clients back thirty times as often).
        wait_s = max(busy)
        return ApiError(
            503,
            f"Every upstream tried is overloaded ({num_tried} tried); retry after {wait_s:g} s.",
            type="server_error",
            code="upstream_overloaded",
            headers={**call.headers, "Retry-After": str(math.ceil(wait_s))},
            extra={"retry_after": wait_s},
        )
    return ApiError(
        502,
        f"No upstream could serve the request ({num_tried or 'none'} tried).",
        type="server_error",
        code="upstream_unavailable",
        headers={**call.headers, "Retry-After": "1"},
        extra={"retry_after": 1.0},
    )


def _timed_out(gw: GatewayState, call: _Call, decision: RouteDecision, what: str) -> ApiError:
    """The refusal for a request its upstream took, then left without `what` for
    `read_timeout_s`: a failure of this request alone, whose connection is closed (the
    upstream sees its client go and stops it). Not retried: the upstream may have worked on
    it all that time, and another would again. Not held against the upstream, and nothing
    else of it is cut: a generation longer than the timeout looks just so, and ejecting its
    upstream for it cut every other request waiting there and sent the long one on to eject
    the next (its health checks say whether it is alive). Charged its whole reservation: the
    tokens it used are not known, and a refund made such requests free."""
    name = decision.upstream
    _give_back(gw, call)
    gw.metrics.upstream_requests.labels(name, "timeout").inc()
    _settle(gw, call, None)
    timeout_s = gw.config.gateway.read_timeout_s
    log.warning("upstream %s sent %s in %g s (read_timeout_s): the request fails", name, what, timeout_s)
    return ApiError(
        504,
        f"The upstream sent {what} within the gateway's read timeout ({timeout_s:g} s); the request "
        "was stopped. Stream it, or ask for fewer tokens, to stay within the timeout.",
        type="server_error",
        code="upstream_timeout",
        headers=call.headers,
    )


class _Retry(Exception):
    """The upstream failed before sending anything: the request may go elsewhere.
    `retry_after_s`: a 503 whose Retry-After said when the upstream expects room. `fault`:
    the upstream answered, wrongly (a 5xx, a reply that is not one, a dropped connection);
    held against it once another upstream serves the same request (`_attempts`)."""

    def __init__(self, why: str, retry_after_s: float | None = None, *, fault: bool = False) -> None:
        super().__init__(why)
        self.retry_after_s = retry_after_s
        self.fault = fault


async def _try_unless_ejected(gw: GatewayState, call: _Call, decision: RouteDecision) -> Response:
    """`_try`, cut if the upstream is ejected before its reply comes (`GatewayState.cut_off`):
    then a `_Retry`, unless the attempt was cancelled for another reason too (its client
    left, or the gateway's drain timed out)."""
    task = asyncio.current_task()
    if task is None:  # not in a task: nothing could cut it
        return await _try(gw, call, decision)
    waiting = gw.awaiting_reply.setdefault(decision.upstream, set())
    waiting.add(task)
    try:
        return await _try(gw, call, decision)
    except asyncio.CancelledError:
        if task in gw.cut_off and task.uncancel() == 0:
            raise _Retry("ejected while its reply was awaited") from None
        raise
    finally:
        waiting.discard(task)
        gw.cut_off.discard(task)


SALTED_KINDS = ("tierserve", "vllm")  # upstreams that take vLLM's `cache_salt`


def _salted(gw: GatewayState, call: _Call, kind: str, fields: dict[str, Any]) -> dict[str, Any]:
    """The body's rewritten `fields` with the `cache_salt` that keeps the request's tenant's
    cached prompt blocks its own on the upstream (`TenantResolver.cache_salt`, as
    `tierserve serve` keys them): an upstream sees one caller, the gateway, so its
    tenants shared each upstream's cache, and a tenant's `cached_tokens` told it which
    prompts another had sent. Hashed to 64 hex characters, which vLLM takes (at most
    128, no '/', '@' or '\\'). SGLang upstreams get the client's salt as sent."""
    salt = gw.tenants.cache_salt(call.tenant, fields.get("cache_salt"))
    if salt is None or kind not in SALTED_KINDS:
        return fields
    return {**fields, "cache_salt": hashlib.sha256(salt.encode("utf-8", "surrogatepass")).hexdigest()}


async def _try(gw: GatewayState, call: _Call, decision: RouteDecision) -> Response:
    upstream = gw.router.state(decision.upstream).config
    fields = call.body.fields  # the ones the gateway rewrites (`body.REWRITTEN`), as sent
    options = fields.get("stream_options") or {}
    if call.stream and not options.get("include_usage"):
        # Asked for the count only: vLLM's continuous_usage_stats, which counts only with
        # include_usage, would put it in every chunk the client sees.
        options = {k: v for k, v in options.items() if k != "continuous_usage_stats"}
        fields = {**fields, "stream_options": {**options, "include_usage": True}}
    fields = _salted(gw, call, upstream.kind, fields)
    down = pass_down(
        upstream.kind,
        fields,
        call.tier,
        call.tenant.name,
        sglang_threshold=gw.config.gateway.sglang_preemption_threshold,
    )
    sent = time.perf_counter()
    try:
        # Returns once the reply's status and headers are in; its body is read as it comes.
        reply = await gw.open_streams().post(
            upstream.url + call.path,
            data=call.body.encode(down.body),
            headers={"Content-Type": "application/json", **down.headers, **upstream.auth_headers},
            allow_redirects=False,  # the request (prompt, tier, tenant) goes to configured upstreams only
        )
    except (aiohttp.ClientError, TimeoutError) as e:
        if isinstance(e, aiohttp.SocketTimeoutError):  # sent, then no reply: a long generation, say
            raise _timed_out(gw, call, decision, "no reply") from None
        why = f"{type(e).__name__}: {e}"
        if isinstance(e, (TimeoutError, aiohttp.ClientConnectorError)):  # no connection at all: out now
            gw.record_failure(
                decision.upstream,
                f"a forwarded request failed ({why})",
                eject_now=True,
                unresponsive=True,
            )
            raise _Retry(why) from None
        raise _Retry(why, fault=True) from None  # a connection dropped (a stale keep-alive, say)
    if 300 <= reply.status < 400:
        # Followed, a 307 re-sent the prompt to wherever it pointed and passed that host's
        # answer on as the upstream's; a 302 turned the POST into a GET. An upstream answers
        # a generation itself, or it is failing.
        reply.release()
        raise _Retry(f"HTTP {reply.status}: a redirect (not followed)", fault=True)
    if reply.status in RETRYABLE_STATUS:
        reply.release()
        wait_s = _retry_after_s(reply) if reply.status == 503 else None
        # A 503 that says when to come back (in seconds or as a date) is a full upstream.
        fault = reply.status != 503 or "retry-after" not in reply.headers
        raise _Retry(f"HTTP {reply.status}", wait_s, fault=fault)
    if call.stream and reply.status == 200 and not _is_event_stream(reply):
        # An HTML page from a proxy, say: not events, so nothing of it may reach the client,
        # as a non-streaming 200 that is not JSON does not; another upstream may answer.
        reply.release()
        why = f"a 200 stream reply of type {reply.content_type!r}, not text/event-stream"
        raise _Retry(why, fault=True)
    if not call.stream or reply.status != 200:
        return await _whole(gw, call, decision, reply)
    return await _stream(gw, call, decision, reply, sent)


async def _stream(
    gw: GatewayState, call: _Call, decision: RouteDecision, reply: aiohttp.ClientResponse, sent: float
) -> Response:
    """A stream's reply: its first whole events read (a failure before them is a `_Retry`),
    then the rest passed on by a `Relay`. `sent`: when the upstream call went out."""
    chunks = reply.content.iter_any()
    forward_usage = bool((call.body.fields.get("stream_options") or {}).get("include_usage"))
    tap = SseUsageTap(forward_usage)
    try:
        first = await _first_events(chunks, tap)
    except (aiohttp.ClientError, TimeoutError, StopAsyncIteration, EventTooLarge, NotServerSentEvents) as e:
        reply.close()
        if isinstance(e, TimeoutError):  # headers, then silence: a long queue there, say
            raise _timed_out(gw, call, decision, "no event of its stream") from None
        raise _Retry(f"stream ended before its first whole event: {type(e).__name__}", fault=True) from None
    except BaseException:  # cancelled (the client left), or a failure no branch foresaw
        reply.close()
        raise
    # The gateway's own share of the first token: before the upstream call (less its queue
    # waits and failed attempts), and from the upstream's first event to the client's (the
    # relay adds that part once it is sent).
    before_s, first_in = sent - call.arrived - call.not_ours_s, time.perf_counter()
    relay = Relay(gw, decision, call.reservation, reply, chunks, tap, first_bytes=(before_s, first_in))
    response = SSEResponse(relay.run(first), call.headers, on_disconnect=relay.client_left)
    call.seat = call.reservation = None  # the relay gives the seat back and settles, when the stream ends
    return response


async def _first_events(chunks: AsyncIterator[bytes], tap: SseUsageTap) -> bytes:
    """The stream's first whole events, as the client will get them. Nothing reaches the
    client before them, so a stream that breaks first (even halfway through an event) may
    still go to another upstream."""
    while True:
        out = tap.feed(await anext(chunks))
        if out:
            if not _is_sse(out):
                raise NotServerSentEvents
            return out


class NotServerSentEvents(ValueError):
    """A stream whose first event is not SSE: text under an event-stream Content-Type."""


# A comment (":..."), a field ("name:value", any name without spaces: unknown ones are
# ignored by a client) or a bare field name ("data": an empty field); not HTML or JSON.
_SSE_LINE = re.compile(rb'(:|[^\s:<{\["]+(:|$))')
_BOM = b"\xef\xbb\xbf"


def _is_sse(events: bytes) -> bool:
    """Whether every line of these whole events is shaped as SSE (a proxy's text or HTML
    under text/event-stream reached the client, then an error event)."""
    lines = events.removeprefix(_BOM).split(b"\n")
    return all(_SSE_LINE.match(line) for line in lines if line)


async def _whole(
    gw: GatewayState, call: _Call, decision: RouteDecision, reply: aiohttp.ClientResponse
) -> Response:
    """A reply read whole: a non-streaming one, or any refusal. A 200 that is not a JSON
    object is a failure before the first byte (retried); any other status reaches the
    client in OpenAI's error envelope, whatever the upstream wrote, with its Retry-After."""
    name = decision.upstream
    try:
        content = await _read_capped(reply, MAX_REPLY_BYTES)
    except (aiohttp.ClientError, TimeoutError) as e:
        if isinstance(e, TimeoutError):  # part of a reply, then silence
            reply.close()
            raise _timed_out(gw, call, decision, "no more of its reply") from None
        raise _Retry(f"reply cut: {type(e).__name__}", fault=True) from None
    except ReplyTooLarge as e:
        _give_back(gw, call)
        gw.metrics.upstream_requests.labels(name, "too_large").inc()
        _settle(gw, call, None)
        log.warning("upstream %s sent a reply over %s bytes; not passed on", name, f"{MAX_REPLY_BYTES:,}")
        raise ApiError(
            502,
            f"The upstream's reply was over {e}.",
            type="server_error",
            code="upstream_reply_too_large",
            headers=call.headers,  # the tier and rate-limit headers, as every other answer
        ) from None
    finally:
        reply.release()
    # The reply is in: an ejection of its upstream from now on has nothing to cut (a cut
    # while the worker parsed it sent the answered request to another upstream, again).
    if (task := asyncio.current_task()) is not None:
        gw.awaiting_reply.get(name, set()).discard(task)
    read = await _read_reply(gw, content, reply.status)
    if reply.status == 200 and not read.is_object:
        raise _Retry("a 200 reply that is not a JSON object", fault=True)
    gw.router.record_request_success(name)  # it answered: a refusal passed on is an answer
    # The answer is built before the seat goes back and the outcome is counted: a header it
    # cannot carry (a Retry-After that is not latin-1) fails here, and is counted once.
    answer: Response | ApiError
    if reply.status == 200 or read.error_envelope:
        headers = {**call.headers, **_retry_after(reply)}
        answer = Response(content, status_code=reply.status, headers=headers, media_type="application/json")
    else:
        answer = _upstream_refusal(name, reply, read.message, call.headers)
    _give_back(gw, call)
    gw.metrics.upstream_requests.labels(name, "ok" if reply.status == 200 else f"http_{reply.status}").inc()
    if reply.status == 200:
        _settle(gw, call, read.usage.total if read.usage else None)  # no count: kept whole, as a stream's
    else:
        _settle(gw, call, 0)
    if isinstance(answer, ApiError):
        raise answer
    return answer


async def _read_reply(gw: GatewayState, content: bytes, status: int) -> ReplyRead:
    """`read_reply`, in the body parser's process for a large reply (a non-streaming
    answer with logprobs runs to megabytes: parsed here, it held every stream). Replies
    below `REPLY_OFFLOAD_BYTES` (about 2 ms of parsing) stay here: the worker is the large
    request bodies' too, and most replies are small."""
    if len(content) > REPLY_OFFLOAD_BYTES:
        job = partial(read_reply, status=status)
        return await gw.body_parser.run(job, "completion", content, wait_for_worker=True)
    return read_reply("completion", content, status)


class ReplyTooLarge(Exception):
    """A non-streaming reply past `MAX_REPLY_BYTES` (its message: the limit, in words)."""


async def _read_capped(reply: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole reply, or `ReplyTooLarge` as soon as it passes `limit` bytes (a reply of
    200 MB was read whole into the gateway's memory)."""
    if reply.content_length is not None and reply.content_length > limit:
        raise ReplyTooLarge(f"{limit:,} bytes")
    pieces: list[bytes] = []
    size = 0
    async for piece in reply.content.iter_any():
        size += len(piece)
        if size > limit:
            raise ReplyTooLarge(f"{limit:,} bytes")
        pieces.append(piece)
    return b"".join(pieces)


def _retry_after_s(reply: aiohttp.ClientResponse) -> float | None:
    """A Retry-After given in seconds (not an HTTP date), if any."""
    try:
        value = float(reply.headers.get("retry-after", ""))
    except ValueError:
        return None
    return value if 0 <= value < 86400 else None


def _is_event_stream(reply: aiohttp.ClientResponse) -> bool:
    """Whether a streamed reply is SSE by its Content-Type; one that names no type is taken
    for SSE (a reply cut before `data: [DONE]` still ends with an error event)."""
    return "content-type" not in reply.headers or reply.content_type == "text/event-stream"


def _retry_after(reply: aiohttp.ClientResponse) -> dict[str, str]:
    value = reply.headers.get("retry-after")
    return {"Retry-After": value} if value else {}


def _upstream_refusal(
    name: str, reply: aiohttp.ClientResponse, message: str, headers: dict[str, str]
) -> ApiError:
    """An upstream's error reply that is not in OpenAI's envelope (vLLM's older top-level
    `message`, FastAPI's `detail`, plain text or HTML), put in it: the same status, the
    upstream's own message (`ReplyRead.message`), and its Retry-After."""
    log.info("upstream %s answered HTTP %d: %s", name, reply.status, message)
    return ApiError(
        reply.status,
        message or f"The upstream answered HTTP {reply.status}.",
        type="invalid_request_error" if reply.status < 500 else "server_error",
        code="upstream_error",
        headers={**headers, **_retry_after(reply)},
    )
