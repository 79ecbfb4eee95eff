"""The settings that open a server up, and those that close a tier of it, each named in a
WARNING line at start-up."""

from __future__ import annotations

import logging
import resource
from collections.abc import Mapping

from tierserve.server.config import ServeConfig
from tierserve.server.tenants import TenantResolver
from tierserve.tiers import ALL_TIERS, Tier

FD_HEADROOM = 64  # descriptors kept for the listening socket, logs, Redis, the model files
# The example configs' API keys end in it (deploy/*.toml): a deployment started from one
# that kept a key serves anyone who has read the repository.
PLACEHOLDER_KEY_MARK = "change-me"


def permissive_settings(config: ServeConfig, redis_fail: str | None = None) -> list[str]:
    """One line per permissive setting of `config` (empty for a locked-down server).
    `redis_fail`: what happens while the limits' Redis is away, where the caller's rule is
    not `[server.ratelimit] fail_mode`'s (the gateway's, by tier); "" for nothing to say."""
    s = config.server
    lines: list[str] = []
    if config.source is None:
        lines.append("no --config: the server is OPEN (no API keys, no rate limits, any tier for anyone)")
    elif not config.tenants:
        lines.append(f"no [tenants.*] in {config.source}: the server is OPEN (no API keys, any tier)")
    mark = PLACEHOLDER_KEY_MARK
    placeholders = sorted(n for n, t in config.tenants.items() if any(mark in k.lower() for k in t.api_keys))
    if placeholders:
        lines.append(
            f"tenants {', '.join(placeholders)}: an API key still holds the example config's "
            f"'{PLACEHOLDER_KEY_MARK}' placeholder, which anyone who has read deploy/*.toml holds: "
            "set keys of your own"
        )
    if s.allow_anonymous:
        anon = TenantResolver(config).anonymous
        lines.append(
            f"server.allow_anonymous = true: requests without an API key run as tenant {anon.name!r} "
            f"at tier {anon.max_tier.name} or lower"
        )
    if s.api_docs and config.requires_key:
        lines.append("server.api_docs = true: /openapi.json, /docs and /redoc are served without an API key")
    if s.tenant_header and config.tenants:
        lines.append(
            "server.tenant_header = true: x-tenant-id selects a tenant without its API key "
            "(safe only behind a proxy that sets the header itself)"
        )
    if s.share_prefix_cache_across_tenants and config.tenants:
        lines.append(
            "server.share_prefix_cache_across_tenants = true: a tenant's cached_tokens (and time to "
            "first token) tell it which prompt prefixes other tenants sent"
        )
    if s.ratelimit.backend == "redis" and redis_fail is None and s.ratelimit.fail_mode == "open":
        redis_fail = (
            "server.ratelimit.fail_mode = open: while Redis is unreachable each replica "
            "enforces the limits on its own"
        )
    if s.ratelimit.backend == "redis" and redis_fail:
        lines.append(redis_fail)
    limited = config.limits.global_limit != type(config.limits.global_limit)() or any(
        t.limit != type(t.limit)() for t in config.tenants.values()
    )
    if config.source is not None and not limited:
        lines.append("no rate limits: neither [limits] nor any tenant sets requests_per_s or tokens_per_s")
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and s.http.max_connections > soft - FD_HEADROOM:
        lines.append(
            f"server.http.max_connections = {s.http.max_connections} but the file-descriptor limit is "
            f"{soft}: raise it (ulimit -n) or lower max_connections, or connections fail at accept"
        )
    return lines


def closed_tiers(config: ServeConfig, ceiling_blocks: Mapping[Tier, int] | None = None) -> list[str]:
    """One line per tier that `tierserve serve` refuses every request of: a queue cap of 0, or
    (given the engine's `ceiling_blocks`, what `prepare` refuses by) no KV block allowed: a
    legitimate setting, but one that looks like an outage from outside. The blocks, not the
    config's ceiling: a policy without tiered memory serves a tier of ceiling 0, and a small
    ceiling may come to 0 blocks. The gateway, which holds no KV cache, gives none."""
    capped = [
        f"limits.queue_cap.{tier.name} = 0: every {tier.name} request is refused (400 tier_closed)"
        for tier, cap in sorted(config.limits.queue_caps.items())
        if cap == 0
    ]
    off = [
        f"tiers.{tier.name}.ceiling = {config.engine.tier(tier).ceiling:g} comes to no KV block: every "
        f"{tier.name} request is refused (400 tier_closed)"
        for tier in ALL_TIERS
        if ceiling_blocks is not None and ceiling_blocks[tier] == 0
    ]
    return capped + off


def log_permissive_settings(config: ServeConfig, log: logging.Logger, redis_fail: str | None = None) -> None:
    for line in permissive_settings(config, redis_fail):
        log.warning("%s", line)
