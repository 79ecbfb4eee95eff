"""The gateway's config: the server's sections plus `[gateway]` and `[[upstreams]]`.

The front half (`[server]`, `[limits]`, `[tenants.*]`, `[tiers.*]`) is parsed by
`parse_serve_config`, exactly as for `tierserve serve`. This module reads the rest:
the upstream replicas, saturation thresholds, flow-control caps, the Redis fail rule of
each tier and the number of gateways sharing the limits. Errors name the field.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tierserve.config import ConfigError, load_raw
from tierserve.server.config import (
    _RATE_KEYS,
    RateLimit,
    ServeConfig,
    _number,
    _rate_limit,
    _reject_unknown,
    _string,
    _table,
    _tier,
    parse_serve_config,
)
from tierserve.tiers import ALL_TIERS, Tier

UPSTREAM_KINDS = ("vllm", "sglang", "tierserve", "openai")
QUEUE_ORDERS = ("priority", "fifo")
# The gateway passes the tier down as a priority to these kinds, expecting them to order by it
# (vLLM under `--scheduling-policy priority` or tierserve's plug-in; under `fcfs` it ignores it and
# its upstream entry should say `order = "fifo"`); a plain endpoint is first come first served.
ORDERS_BY_PRIORITY = ("vllm", "sglang", "tierserve")
DEFAULT_MAX_WAIT_S: dict[Tier, float] = {Tier.P0: 2.0, Tier.P1: 10.0, Tier.P2: 60.0, Tier.P3: 120.0}


@dataclass(frozen=True)
class UpstreamConfig:
    name: str
    kind: str  # one of UPSTREAM_KINDS
    url: str  # base URL, without /v1
    max_in_flight: int = 0  # this gateway's requests in flight to it that saturate it; 0 = no cap
    order: str | None = None  # how it orders its waiting queue, one of QUEUE_ORDERS; None: by kind
    # The key it wants (vLLM's and SGLang's --api-key), read at start-up from the environment
    # variable `api_key_env` names; kept out of reprs and logs.
    api_key: str | None = field(default=None, repr=False)

    @property
    def auth_headers(self) -> dict[str, str]:
        """What every call to it carries: its API key, where it wants one."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def orders_by_priority(self) -> bool:
        """Whether it runs waiting work of a more urgent tier first (then work of a less
        urgent tier does not delay a request); else its waiting queue is first come first served."""
        if self.order is not None:
            return self.order == "priority"
        return self.kind in ORDERS_BY_PRIORITY


@dataclass(frozen=True)
class GatewaySettings:
    instances: int = 1  # gateways sharing the limits: on Redis loss each keeps 1/instances of them
    policy: str = "hybrid"  # order of the tier queues (a tierserve scheduling policy)
    redis_fail_open: Mapping[Tier, bool] = field(default_factory=dict)  # per tier; unset = [server.ratelimit]
    tier_limits: Mapping[Tier, RateLimit] = field(default_factory=dict)
    max_wait_s: Mapping[Tier, float] = field(default_factory=lambda: dict(DEFAULT_MAX_WAIT_S))
    max_waiting: int = 4  # waiting requests ahead of a request's tier at which an upstream is full for it
    max_kv_usage: float = 0.95  # scraped KV-cache usage (0..1) at which it counts as saturated
    scrape_interval_s: float = 0.5
    stale_after_s: float = 3.0  # metrics older than this: saturated
    eject_after_failures: int = 2  # consecutive failed checks (or a failed connect) eject an upstream
    # Forwarded requests failed in a row (a 5xx, a reply that is not one) that eject an
    # upstream whose checks pass; it stays out `ejection_hold_s`, doubled for each such
    # ejection in a row, up to `max_ejection_hold_s`, whatever its checks say.
    eject_after_request_failures: int = 3
    ejection_hold_s: float = 10.0
    max_ejection_hold_s: float = 300.0
    prefix_chars: int = 512  # prompt characters hashed for prefix affinity
    affinity_load_bound: float = 1.5  # the preferred replica is used while its load <= bound x (least + 1)
    sglang_preemption_threshold: int = 10  # SGLang tiers are spaced one more than this apart
    connect_timeout_s: float = 2.0
    # An upstream silent this long (no reply yet, or no next chunk of a stream) has failed:
    # the OpenAI Python client's own default timeout, 10 minutes.
    read_timeout_s: float = 600.0
    max_attempts: int = 3  # upstreams tried for one request before its first byte


# Scrapes of every upstream this often at least: at 1 us the gateway spent 45 % of a core
# on them and saw every upstream as saturated.
MIN_SCRAPE_INTERVAL_S = 0.05
MAX_UPSTREAM_NAME = 128


@dataclass(frozen=True)
class GatewayConfig:
    serve: ServeConfig
    gateway: GatewaySettings
    upstreams: tuple[UpstreamConfig, ...]


def _upstream(i: int, raw: Mapping[str, Any], names: set[str], urls: dict[str, int]) -> UpstreamConfig:
    path = f"upstreams[{i}]"
    _reject_unknown(path, raw, ("name", "kind", "url", "max_in_flight", "order", "api_key_env"))
    url = _base_url(f"{path}.url", _string(f"{path}.url", raw.get("url")))
    # One replica listed twice would take twice its share and be counted as two.
    same = urls.setdefault(_same_replica_key(url), i)
    if same != i:
        raise ConfigError(f"{path}.url: {url!r} is already upstreams[{same}]'s (one entry per replica)")
    name = _string(f"{path}.name", raw.get("name", urlparse(url).netloc))
    if not name.isprintable() or len(name) > MAX_UPSTREAM_NAME:  # a log line's word, a metrics label
        raise ConfigError(f"{path}.name: 1..{MAX_UPSTREAM_NAME} printable characters, got {name[:80]!r}")
    if name in names:
        raise ConfigError(f"{path}.name: {name!r} is used twice")
    names.add(name)
    return UpstreamConfig(
        name=name,
        kind=_string(f"{path}.kind", raw.get("kind"), UPSTREAM_KINDS),
        url=url,
        max_in_flight=int(
            _number(f"{path}.max_in_flight", raw.get("max_in_flight", 0), minimum=0, integer=True)
        ),
        order=_string(f"{path}.order", raw["order"], QUEUE_ORDERS) if "order" in raw else None,
        api_key=_api_key(f"{path}.api_key_env", raw["api_key_env"]) if "api_key_env" in raw else None,
    )


def _api_key(path: str, raw: Any) -> str:
    """The key in the environment variable `raw` names (a key is not written in the file)."""
    variable = _string(path, raw)
    key = os.environ.get(variable, "").strip()
    if not key:
        raise ConfigError(f"{path}: the environment variable {variable} is not set (or empty)")
    return key


def _base_url(path: str, text: str) -> str:
    """An upstream's base URL, the API's paths (`/v1/...`, `/metrics`) appended to it:
    http(s), a host, a port of 1-65535 if one is given, and no query, fragment or `/v1`."""
    if text != text.strip():  # urlparse drops leading blanks, httpx does not: never admitted
        raise ConfigError(f"{path}: spaces around the URL, got {text!r}")
    url = text.rstrip("/")
    parsed = urlparse(url)
    try:
        port = parsed.port
    except ValueError:  # not a number, or out of 0-65535
        port = 0
    if parsed.scheme not in ("http", "https") or not parsed.hostname or port == 0:
        raise ConfigError(f"{path}: expected http(s)://host:port with a port of 1-65535, got {text!r}")
    if parsed.query or parsed.fragment or url.endswith("/v1"):
        raise ConfigError(f"{path}: expected the base URL, without /v1, a query or a fragment, got {text!r}")
    if parsed.username is not None or parsed.password is not None:
        # The default name (host:port) is a metrics label and is listed by /v1/models.
        raise ConfigError(
            f"{path}: expected no user or password in the URL (the gateway sends no credentials upstream), "
            f"got one for {parsed.hostname}"
        )
    return url


def _same_replica_key(url: str) -> str:
    """What two spellings of one replica's URL share: scheme, host (any case), port (the
    scheme's own when none is given) and path."""
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    return f"{parsed.scheme}://{(parsed.hostname or '').lower()}:{port}{parsed.path}"


def _per_tier(raw: Mapping[str, Any], key: str) -> dict[Tier, Any]:
    """`[gateway.<key>]`: a value per tier name; one tier under two names is refused, as in
    `[tiers]` (the last one given won: `P3` and `background` loosened P3's limit)."""
    table = _table(f"gateway.{key}", raw.get(key, {}))
    out: dict[Tier, Any] = {}
    given: dict[Tier, str] = {}
    for name, value in table.items():
        tier = _tier(f"gateway.{key}.{name}", name)
        if tier in out:
            raise ConfigError(
                f"gateway.{key}.{name}: tier {tier.name} is given twice (also as {given[tier]})"
            )
        out[tier], given[tier] = value, name
    return out


def _tier_limit(tier: Tier, value: Any) -> RateLimit:
    path = f"gateway.tier_limits.{tier.name}"
    table = _table(path, value)
    _reject_unknown(path, table, _RATE_KEYS)  # a misspelt key would leave the tier unlimited
    return _rate_limit(path, table)


def _settings(raw: Mapping[str, Any]) -> GatewaySettings:
    base = GatewaySettings()
    numbers = {
        "instances": (1, True, False),
        "max_waiting": (1, True, False),
        "max_kv_usage": (0.0, False, True),
        "scrape_interval_s": (MIN_SCRAPE_INTERVAL_S, False, False),
        "stale_after_s": (0.0, False, True),
        "eject_after_failures": (1, True, False),
        "eject_after_request_failures": (1, True, False),
        "ejection_hold_s": (0.0, False, False),
        "max_ejection_hold_s": (0.0, False, False),
        "prefix_chars": (1, True, False),
        "affinity_load_bound": (1.0, False, False),
        "sglang_preemption_threshold": (0, True, False),
        "connect_timeout_s": (0.0, False, True),
        "read_timeout_s": (0.0, False, True),
        "max_attempts": (1, True, False),
    }
    _reject_unknown("gateway", raw, (*numbers, "policy", "redis_fail", "tier_limits", "max_wait_s"))
    values: dict[str, Any] = {}
    for key, (minimum, integer, strict) in numbers.items():
        v = _number(
            f"gateway.{key}",
            raw.get(key, getattr(base, key)),
            minimum=minimum,
            integer=integer,
            strict=strict,
        )
        values[key] = int(v) if integer else v
    fail = {
        t: _string(f"gateway.redis_fail.{t.name}", v, ("open", "closed")) == "open"
        for t, v in _per_tier(raw, "redis_fail").items()
    }
    limits = {t: _tier_limit(t, v) for t, v in _per_tier(raw, "tier_limits").items()}
    waits = dict(DEFAULT_MAX_WAIT_S)
    for t, v in _per_tier(raw, "max_wait_s").items():
        waits[t] = _number(f"gateway.max_wait_s.{t.name}", v, minimum=0.0)
    if values["max_kv_usage"] > 1:
        raise ConfigError(
            f"gateway.max_kv_usage: a share of the KV cache in (0, 1], got {values['max_kv_usage']}"
        )
    if values["ejection_hold_s"] > values["max_ejection_hold_s"]:  # it was cut to the most, unsaid
        raise ConfigError(
            f"gateway.ejection_hold_s: {values['ejection_hold_s']:g} s is longer than max_ejection_hold_s "
            f"({values['max_ejection_hold_s']:g} s), the most it may double to"
        )
    if values["stale_after_s"] < values["scrape_interval_s"]:
        raise ConfigError(
            f"gateway.stale_after_s: {values['stale_after_s']} s is shorter than scrape_interval_s "
            f"({values['scrape_interval_s']} s): every upstream would always look stale (saturated)"
        )
    from tierserve.scheduling import POLICIES

    policy = _string("gateway.policy", raw.get("policy", base.policy), tuple(POLICIES))
    return GatewaySettings(
        policy=policy, redis_fail_open=fail, tier_limits=limits, max_wait_s=waits, **values
    )


def _serve_and_settings(raw: Mapping[str, Any], source: str | None) -> tuple[ServeConfig, GatewaySettings]:
    rest = {k: v for k, v in raw.items() if k not in ("gateway", "upstreams")}
    return parse_serve_config(rest, source=source), _settings(_table("gateway", raw.get("gateway", {})))


def parse_gateway_settings(raw: Mapping[str, Any], source: str | None = None) -> GatewaySettings:
    """`[gateway]`, with the file's other sections checked as `parse_gateway_config` checks
    them (an unknown section is an error); its [[upstreams]] are not read."""
    return _serve_and_settings(raw, source)[1]


def parse_gateway_config(raw: Mapping[str, Any], source: str | None = None) -> GatewayConfig:
    serve, settings = _serve_and_settings(raw, source)
    ups = raw.get("upstreams", [])
    if not isinstance(ups, list) or not ups:
        raise ConfigError("upstreams: expected at least one [[upstreams]] table")
    names: set[str] = set()
    urls: dict[str, int] = {}
    upstreams = tuple(_upstream(i, _table(f"upstreams[{i}]", u), names, urls) for i, u in enumerate(ups))
    return GatewayConfig(serve=serve, gateway=settings, upstreams=upstreams)


def load_gateway_config(path: str | Path) -> GatewayConfig:
    return parse_gateway_config(load_raw(path), source=str(path))


def redis_fail_summary(config: GatewayConfig) -> str:
    """The tiers that keep running while the limits' Redis is away, and on what, in one
    line for the start-up warnings; "" where every tier is refused then (nothing open)."""
    fail_open = fail_open_by_tier(config)
    kept = [t.name for t in ALL_TIERS if fail_open[t]]
    if not kept:
        return ""
    instances = config.gateway.instances
    share = "the whole of each limit" if instances == 1 else f"1/{instances} of each limit"
    refused = [t.name for t in ALL_TIERS if not fail_open[t]]
    also = f"; {', '.join(refused)} requests are refused (503)" if refused else ""
    return (
        f"while the rate-limit Redis is unreachable, each gateway limits {', '.join(kept)} requests on "
        f"its own, on {share} ([gateway.redis_fail], gateway.instances = {instances}){also}"
    )


def fail_open_by_tier(config: GatewayConfig) -> dict[Tier, bool]:
    """Each tier's Redis rule: its own `[gateway.redis_fail]` entry, else `[server.ratelimit] fail_mode`."""
    default = config.serve.server.ratelimit.fail_mode == "open"
    return {t: config.gateway.redis_fail_open.get(t, default) for t in ALL_TIERS}


def waits_shorter_than_the_queues_way_out(config: GatewayConfig) -> list[str]:
    """One line per tier whose `max_wait_s` ends before hybrid would serve its oldest request
    ahead of more urgent tiers (its rescue, a quarter of its TTFT target, for P1-P2; its
    `aging_s`): under a steady backlog of a more urgent tier, such a tier's requests all
    time out while a less urgent tier's, aged, are served (a review: a P2 wait of 6 s under a
    P1 flood, P2's rescue at 15 s, P3 aged at 5 s: every P2 request timed out, P3 served)."""
    from tierserve.scheduling.hybrid import AGED_TIERS, RESCUE_FRACTION, RESCUED_TIERS

    if config.gateway.policy != "hybrid":
        return []
    lines = []
    for tier in AGED_TIERS:
        tier_config = config.serve.engine.tier(tier)
        rescue_s = RESCUE_FRACTION * tier_config.ttft_target_s if tier in RESCUED_TIERS else math.inf
        out_s = min(rescue_s, tier_config.aging_s)
        wait_s = config.gateway.max_wait_s[tier]
        if wait_s < out_s:
            lines.append(
                f"gateway.max_wait_s.{tier.name} = {wait_s:g} s ends before the queue serves a {tier.name} "
                f"request ahead of a backlog of more urgent tiers ({out_s:g} s: "
                + ("its rescue, a quarter of its TTFT target" if out_s == rescue_s else "its aging_s")
                + f"): under such a backlog every {tier.name} request times out"
            )
    return lines
