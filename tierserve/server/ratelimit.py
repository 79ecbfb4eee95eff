"""Global and per-tenant rate limits in requests/s and tokens/s, with OpenAI's headers.

A request is charged one request (`acquire_request`) as soon as its key is known, before
its body is read: a body that is then refused (a 400, a 429 for its tokens) keeps that
charge, so a tenant's request rate bounds the bodies it can make the server read and
parse, valid or not. Its tokens are charged once the body is known (`acquire`, passed the
first charge so that the request buckets are not charged again). It reserves
``prompt tokens + max_tokens`` up front; `settle` corrects the token
buckets with the real count when it ends. A request that no token bucket could ever hold
at once is "too_large" (a 400 at the front door: waiting would not help), except that an
output length the client did not ask for (the server's default) is first cut to fit.

When a Redis backend is configured and unreachable, the limiter falls back by rule:
fail-open keeps serving on in-process buckets, fail-closed refuses; it retries Redis after
`REDIS_RETRY_S`. Both are visible through `redis_up` and `num_fallbacks` (exported as
metrics), and each outage and each recovery is logged once (WARNING), however many
requests meet it.

Several processes sharing one Redis (gateways) add per-tier buckets (`tier_limits`), a
fail rule per tier (`fail_open_tiers`), and `local_share` = 1/N: on fallback each of the
N processes limits on buckets of 1/N of the configured rate and burst, so the fleet as a
whole stays near the limit instead of admitting N times it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple
from urllib.parse import urlparse

from tierserve.server.buckets import Bucket, BucketBackend, LocalBuckets, TakeResult
from tierserve.server.config import RateLimit, TenantConfig
from tierserve.tiers import Tier

log = logging.getLogger("tierserve.ratelimit")

REDIS_RETRY_S = 1.0
OUTAGE_LOG_S = 10.0  # at most one outage line (and its end) this often


@dataclass(frozen=True, slots=True)
class Reservation:
    backend: BucketBackend
    buckets: tuple[Bucket, ...]  # those debited (token buckets; the request buckets of a charge)
    num_tokens: int  # what was debited from each


@dataclass(frozen=True, slots=True)
class RateDecision:
    allowed: bool
    headers: dict[str, str]  # x-ratelimit-* (and Retry-After when refused)
    retry_after_s: float = 0.0
    reason: str = ""  # when refused: "requests", "tokens", "too_large" or "unavailable"
    message: str = ""
    reservation: Reservation | None = None
    fell_back: bool = False  # decided on the in-process buckets because Redis did not answer
    charge: Reservation | None = None  # `acquire_request`'s: the request buckets it debited


def format_reset(seconds: float) -> str:
    """A duration as OpenAI writes it in x-ratelimit-reset-*: "20ms", "1.5s", "6m0s"."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, secs = divmod(round(seconds, 3), 60)
    if minutes:
        return f"{int(minutes)}m{secs:g}s"
    return f"{secs:g}s"


def _buckets(prefix: str, limit: RateLimit) -> tuple[Bucket | None, Bucket | None]:
    requests = None
    if limit.requests_per_s is not None:
        requests = Bucket(
            f"{prefix}:requests", limit.requests_per_s, limit.request_burst or max(1.0, limit.requests_per_s)
        )
    tokens = None
    if limit.tokens_per_s is not None:
        tokens = Bucket(
            f"{prefix}:tokens", limit.tokens_per_s, limit.token_burst or max(1.0, limit.tokens_per_s)
        )
    return requests, tokens


class RateLimiter:
    def __init__(
        self,
        global_limit: RateLimit,
        *,
        remote: BucketBackend | None = None,
        fail_open: bool = True,
        now: Callable[[], float] = time.monotonic,
        tier_limits: Mapping[Tier, RateLimit] | None = None,
        fail_open_tiers: Mapping[Tier, bool] | None = None,
        local_share: float = 1.0,
    ) -> None:
        if not 0 < local_share <= 1:
            raise ValueError(f"local_share must be in (0, 1], got {local_share}")
        self._global = _buckets("global", global_limit)
        self._tiers = {t: _buckets(f"tier:{t.name}", lim) for t, lim in (tier_limits or {}).items()}
        self._fail_open_tiers = dict(fail_open_tiers or {})
        self._local_share = local_share
        self._local = LocalBuckets(now)
        self._remote = remote
        self._fail_open = fail_open
        self._now = now
        self._remote_down_until = -math.inf
        self._outage_said = False  # the current outage's WARNING line was written
        self._outage_said_at = -math.inf
        self._tenant_buckets: dict[str, tuple[Bucket | None, Bucket | None]] = {}
        self.num_fallbacks = 0  # operations served locally (or refused) because Redis failed
        self.num_redis_errors = 0  # operations on Redis that failed
        self.redis_up: bool | None = None if remote is None else True

    def _for_tenant(
        self, tenant: TenantConfig, tier: Tier | None, *, requests_charged: bool = False
    ) -> tuple[list[Bucket], list[Bucket]]:
        """The request and token buckets of a request; `requests_charged`: the global and
        tenant request buckets were charged already (`acquire_request`), so only the tier's
        request bucket is left among the request buckets."""
        own = self._tenant_buckets.get(tenant.name)
        if own is None:
            own = _buckets(f"tenant:{tenant.name}", tenant.limit)
            if own != (None, None):  # an unlimited (e.g. ad-hoc) tenant leaves nothing behind
                self._tenant_buckets[tenant.name] = own
        per_tier = self._tiers.get(tier, (None, None)) if tier is not None else (None, None)
        early = () if requests_charged else (self._global[0], own[0])
        requests = [b for b in (*early, per_tier[0]) if b is not None]
        tokens = [b for b in (self._global[1], own[1], per_tier[1]) if b is not None]
        return requests, tokens

    def _fails_open(self, tier: Tier | None) -> bool:
        """The rule while Redis does not answer for a request of `tier`; None: its tier is
        not known yet (the first charge, before the body), which falls back while any tier's
        rule does: the charge of its tokens applies the tier's own rule."""
        if tier is not None:
            return self._fail_open_tiers.get(tier, self._fail_open)
        return any(self._fail_open_tiers.get(t, self._fail_open) for t in Tier)

    def fail_rule(self) -> str:
        """What happens to a decision while Redis does not answer, in words for the log."""
        if self._fail_open_tiers:
            by_tier = self._fail_open_tiers.items()
            rules = ", ".join(f"{t.name} {'open' if fail_open else 'closed'}" for t, fail_open in by_tier)
            return f"each tier follows its rule ({rules})"
        if self._fail_open:
            return "fail_mode open: each process limits on its own buckets"
        return "fail_mode closed: requests are refused (503)"

    async def check_remote(self, where: str, timeout_s: float) -> None:
        """Ask Redis once, at start-up: one that does not answer is said in one WARNING line
        naming `where` and the error, and exported as down (not up until the first request
        finds out)."""
        ping = getattr(self._remote, "ping", None)  # a backend without one (a test's) is not asked
        if ping is None:
            return
        try:
            await asyncio.wait_for(ping(), timeout=timeout_s)
            return
        except Exception as e:  # any failure to answer: refused, timed out, auth, a bad database
            why = _why(e)
        rule = self.fail_rule()
        log.warning("rate-limit Redis %s unreachable at start-up (%s): %s until it answers", where, why, rule)
        self.redis_up = False
        self._outage_said, self._outage_said_at = True, self._now()

    def _mark_redis(self, up: bool, error: BaseException | None = None) -> None:
        """Note Redis's answer (or its failure). An outage is said in one WARNING line, and
        its end in another, at most once every OUTAGE_LOG_S: a Redis slow by turns (each
        decision timing out, the next answered) wrote 34 lines a second."""
        now = self._now()
        if up:
            # It answered: decisions go to it again at once (they went on falling back for the
            # rest of the second while /metrics said it was up, and the outage was logged again).
            self._remote_down_until = -math.inf
            if self.redis_up is False and self._outage_said:
                log.warning("rate-limit Redis is back (reachable again): limits are global again")
                self._outage_said = False
        else:
            self.num_redis_errors += 1
            quiet = now - self._outage_said_at < OUTAGE_LOG_S
            if not self._outage_said and not quiet:  # not said yet: now, or once the quiet ends
                why = "" if error is None else f" ({_why(error)})"
                log.warning("rate-limit Redis unreachable%s: %s", why, self.fail_rule())
                self._outage_said, self._outage_said_at = True, now
            self._remote_down_until = now + REDIS_RETRY_S
        self.redis_up = up

    async def _run_take(
        self, requests: list[Bucket], tokens: list[Bucket], num_tokens: int, tier: Tier | None
    ) -> _Taken | None:
        """One request from each of `requests` and `num_tokens` from each of `tokens`: on Redis
        when configured and up; None when it is down and the rule is fail-closed. On fallback
        the buckets are the local share of each, and the tokens are cut to the smallest share
        (the settle charges the rest): a request past a share's burst but within the whole
        one got 429s that never cleared."""
        buckets = requests + tokens

        def costs(n: int) -> list[float]:
            return [1.0] * len(requests) + [float(n)] * len(tokens)

        remote = self._remote
        if remote is not None and self._now() >= self._remote_down_until:
            try:
                result = await remote.take(buckets, costs(num_tokens))
                self._mark_redis(True)
                return _Taken(result, remote, buckets, num_tokens)
            except (TimeoutError, OSError, ConnectionError, _redis_error()) as e:
                self._mark_redis(False, e)
        if remote is not None:
            self.num_fallbacks += 1
            if not self._fails_open(tier):
                return None
            if self._local_share < 1:
                share = self._local_share
                buckets = [
                    replace(b, rate_per_s=b.rate_per_s * share, capacity=max(1.0, b.capacity * share))
                    for b in buckets
                ]
                if tokens:
                    num_tokens = min(
                        num_tokens, math.floor(min(b.capacity for b in buckets[len(requests) :]))
                    )
        return _Taken(self._local.take_now(buckets, costs(num_tokens)), self._local, buckets, num_tokens)

    async def acquire_request(self, tenant: TenantConfig) -> RateDecision:
        """Charge one request to the global and the tenant's request buckets, before the body
        is read: refused as "requests" when one is empty, as "tokens" when a token bucket is
        in debt (the request could not pass it, whatever its size), or "unavailable" (Redis
        down and fail-closed). The token buckets are read, not charged (a cost of 0, in the
        same atomic take), so that the headers name both kinds. The charge stays whatever the
        request's answer; pass the decision to `acquire` as `charged`."""
        requests, tokens = self._for_tenant(tenant, None)
        if not requests:
            return RateDecision(allowed=True, headers={})
        outcome = await self._run_take(requests, tokens, 0, None)
        if outcome is None:
            return _unavailable()
        result, backend, taken, _ = outcome
        if not result.allowed:
            return _over_limit(list(taken), result, len(requests))
        headers = _headers(list(taken), result, len(requests))
        fell_back = self._remote is not None and backend is self._local
        charge = Reservation(backend, tuple(taken[: len(requests)]), 1)
        return RateDecision(allowed=True, headers=headers, fell_back=fell_back, charge=charge)

    async def acquire(
        self,
        tenant: TenantConfig,
        num_tokens: int,
        tier: Tier | None = None,
        *,
        num_default: int = 0,
        charged: RateDecision | None = None,
    ) -> RateDecision:
        """`tier`: the tier the request runs at (its buckets and fail rule); None = no tier rules.
        `num_default`: how many of `num_tokens` are the server's default output length rather
        than a max_tokens the client sent. Where the request is larger than the smallest token
        bucket, that part is cut to fit it (down to one output token): the reservation is only
        a guess of the real count, which `settle` charges. A request still too large, even with
        a full bucket, is refused as "too_large", with no Retry-After: it would never fit.
        `charged`: the request's `acquire_request`, whose request buckets are not charged
        again (its headers come back with this decision's); None charges them here."""
        requests, tokens = self._for_tenant(tenant, tier, requests_charged=charged is not None)
        early = charged.headers if charged is not None else {}
        if charged is not None and charged.fell_back and not self._fails_open(tier):
            # Charged on the local buckets while the tier's rule is closed: refused, as it
            # would have been before its body, so the charge goes back.
            await self.settle(charged.charge, 0)
            return _unavailable()
        if not requests and not tokens:
            return RateDecision(allowed=True, headers=dict(early))
        tightest = min(tokens, key=lambda b: b.capacity, default=None)  # the one to name
        if tightest is not None and num_tokens > tightest.capacity:
            least = num_tokens - num_default + (1 if num_default > 0 else 0)
            if least > tightest.capacity:
                what = "the prompt and one output token" if num_default > 0 else "the prompt + max_tokens"
                message = (
                    f"{least} tokens requested ({what}); {_scope(tightest.key)} allows at most "
                    f"{tightest.capacity:g} at once (its token_burst), so this request can never run"
                )
                return RateDecision(allowed=False, headers=dict(early), reason="too_large", message=message)
            num_tokens = math.floor(tightest.capacity)  # >= least, a whole number of tokens
        outcome = await self._run_take(requests, tokens, num_tokens, tier)
        if outcome is None:
            return _unavailable()
        result, backend, taken, num_taken = outcome
        if not result.allowed:
            refused = _over_limit(list(taken), result, len(requests))
            return replace(refused, headers={**early, **refused.headers})
        reservation = Reservation(backend, tuple(taken[len(requests) :]), num_taken) if tokens else None
        headers = {**early, **_headers(list(taken), result, len(requests))}
        return RateDecision(allowed=True, headers=headers, reservation=reservation)

    async def settle(self, reservation: Reservation | None, num_tokens_used: int) -> None:
        """Refund (or charge) the difference between the reserved and the real token count."""
        if reservation is None or num_tokens_used == reservation.num_tokens:
            return
        delta = float(reservation.num_tokens - num_tokens_used)
        for bucket in reservation.buckets:
            try:
                await reservation.backend.give(bucket, delta)
            except (TimeoutError, OSError, ConnectionError, _redis_error()) as e:
                self.num_fallbacks += 1
                self._mark_redis(False, e)


def _unavailable() -> RateDecision:
    """Redis did not answer and the rule is fail-closed."""
    return RateDecision(
        allowed=False,
        headers={"Retry-After": str(math.ceil(REDIS_RETRY_S))},
        retry_after_s=REDIS_RETRY_S,
        reason="unavailable",
    )


def _over_limit(taken: list[Bucket], result: TakeResult, num_request_buckets: int) -> RateDecision:
    """A refused take: which kind of bucket was short, when it will fit, and the headers."""
    headers = _headers(taken, result, num_request_buckets)
    wait = result.wait_s
    headers["Retry-After"] = str(max(1, math.ceil(wait)))
    headers["retry-after-ms"] = str(max(1, math.ceil(wait * 1000)))
    req_short = any(lv.wait_s > 0 for lv in result.levels[:num_request_buckets])
    short = next(b for b, lv in zip(taken, result.levels, strict=True) if lv.wait_s > 0)
    kind = "requests" if req_short else "tokens"
    return RateDecision(
        allowed=False,
        headers=headers,
        retry_after_s=wait,
        reason=kind,
        message=f"Rate limit reached: {_scope(short.key)} ({kind}).",
    )


class _Taken(NamedTuple):
    result: TakeResult
    backend: BucketBackend
    buckets: Sequence[Bucket]  # those debited: on fallback, the local share of each
    num_tokens: int  # taken from each token bucket


def _scope(bucket_key: str) -> str:
    """Whose limit a bucket is, from its key: `global:...`, `tenant:NAME:...`, `tier:P1:...`."""
    owner = bucket_key.rsplit(":", 1)[0]
    if owner == "global":
        return "the server-wide limit"
    kind, _, name = owner.partition(":")
    return f"tenant {name!r}" if kind == "tenant" else f"tier {name}"


def _why(error: BaseException) -> str:
    """An error in a few words for the log: its class and message (and, for a Redis that
    wants a password, where it goes: its own text speaks of HELLO and AUTH)."""
    message = str(error)
    why = f"{type(error).__name__}: {message}" if message else type(error).__name__
    if type(error).__name__ == "AuthenticationError" or "NOAUTH" in message:
        why += "; the password goes in redis_url (redis://:PASSWORD@host:port/0)"
    return why


def redis_where(url: str) -> str:
    """Where a Redis URL points, for the log: host and port (or the socket), never the password."""
    parts = urlparse(url)
    where = f"{parts.hostname}:{parts.port or 6379}" if parts.hostname else parts.path
    return f"{where}/{parts.path.lstrip('/')}" if parts.hostname and parts.path.strip("/") else where


def _redis_error() -> type[Exception]:
    try:
        import redis
    except ImportError:  # pragma: no cover - redis is a dependency
        return OSError
    return redis.RedisError


def _headers(buckets: list[Bucket], result: TakeResult, num_request_buckets: int) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers, from the tightest bucket of each kind."""
    headers: dict[str, str] = {}
    groups = (("requests", 0, num_request_buckets), ("tokens", num_request_buckets, len(buckets)))
    for name, lo, hi in groups:
        if lo == hi:
            continue
        i = min(range(lo, hi), key=lambda j: result.levels[j].remaining)
        bucket, level = buckets[i], result.levels[i]
        headers[f"x-ratelimit-limit-{name}"] = str(int(bucket.capacity))
        headers[f"x-ratelimit-remaining-{name}"] = str(max(0, math.floor(level.remaining)))
        headers[f"x-ratelimit-reset-{name}"] = format_reset(level.reset_s(bucket))
    return headers
