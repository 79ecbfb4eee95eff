"""The refusals every front door sends (server and gateway): draining, rate limit, overload.

One home for their status, code, message and headers, so `tierserve serve` and
`tierserve gateway` answer a refused request the same way.
"""

from __future__ import annotations

from collections.abc import Callable

from tierserve.server.config import TenantConfig
from tierserve.server.errors import ApiError
from tierserve.server.ratelimit import RateDecision, RateLimiter
from tierserve.tiers import Tier


def draining_error(*, unread: bool = False) -> ApiError:
    """`unread`: the request's body is not (all) read, so the connection closes."""
    return ApiError(
        503,
        "The server is shutting down; retry on another replica.",
        type="server_error",
        code="draining",
        headers={"Retry-After": "1", **({"connection": "close"} if unread else {})},
        extra={"retry_after": 1.0},
    )


def rate_refusal(
    rate: RateDecision, tenant: str, headers: dict[str, str], *, param: str | None = None
) -> ApiError:
    """A refused `RateDecision` as a 429 (over a limit), a 503 (limiter down, fail-closed), or
    a 400 naming `param` (the body field to lower) for a request larger than a token bucket
    can ever hold: a 429 would tell the client to retry (OpenAI's SDK does, by itself), and
    the same request would be refused every time."""
    if rate.reason == "too_large":
        return ApiError(400, rate.message, param=param, code="tokens_exceed_burst", headers=headers)
    if rate.reason == "unavailable":
        return ApiError(
            503,
            "Rate limiter unavailable (fail-closed).",
            type="server_error",
            code="ratelimit_unavailable",
            headers=headers,
            extra={"retry_after": rate.retry_after_s},
        )
    message = rate.message or f"Rate limit reached for tenant {tenant!r} ({rate.reason})."
    return ApiError(
        429,
        message,
        type="tokens" if rate.reason != "requests" else "requests",
        code="rate_limit_exceeded",
        headers=headers,
    )


async def charge_request(
    limiter: RateLimiter, tenant: TenantConfig, reject: Callable[[str, Tier | None], None]
) -> RateDecision:
    """One request from the tenant's (and the server's) request buckets, once its key is
    known and before its body is read; the 429 (or the 503 of a fail-closed limiter without
    Redis) when they are empty, counted by `reject` with no tier (none is known yet). A
    request refused afterwards, for its body or its tokens, keeps the charge: a body that
    failed validation was never charged, so a tenant's request rate did not bound the bodies
    it could make the server parse (an attack trial: 58 a second from a tenant allowed 5)."""
    rate = await limiter.acquire_request(tenant)
    if not rate.allowed:
        reject(f"rate_limit_{rate.reason}", None)
        raise rate_refusal(rate, tenant.name, dict(rate.headers))
    return rate


def overloaded(
    tier: Tier,
    reason: str,
    retry_after_s: float,
    queue_depth: int,
    estimated_wait_s: float | None,
    headers: dict[str, str],
) -> ApiError:
    """A 503 for a tier whose queue is full (or whose wait would miss its deadline)."""
    retry = round(retry_after_s, 3)
    headers = {**headers, "Retry-After": str(max(1, int(retry + 0.999)))}
    # The gateway has no estimate of its own: it says when to come back, as its header does
    # ("estimated wait unknown" beside a Retry-After read as a contradiction).
    if estimated_wait_s is None:
        wait = f"retry after {retry:g} s"
    else:
        wait = f"estimated wait {estimated_wait_s:.2f} s"
    return ApiError(
        503,
        f"Tier {tier.name} is overloaded ({reason}; {wait}).",
        type="server_error",
        code=reason,
        headers=headers,
        extra={"retry_after": retry, "current_queue_depth": queue_depth},
    )


def queue_closed(tier: Tier) -> ApiError:
    """The 400 for a tier whose queue cap is 0: no request of it may wait, so none is
    served (a 503 `queue_full` told clients to retry, and the OpenAI client did, for ever)."""
    return ApiError(
        400,
        f"Tier {tier.name} is not served here: its queue may hold no request "
        f"(limits.queue_cap.{tier.name} = 0).",
        code="tier_closed",
    )
