"""The server's part of the TOML config: `[server]`, `[limits]` and `[tenants.*]`.

`tierserve.config` parses `[scheduler]` and `[tiers.*]` and leaves these three tables to
this module, which validates them strictly: an unknown key or a bad value raises
`ConfigError` naming the field (e.g. ``tenants.acme.max_tier``). Everything is frozen.
"""

from __future__ import annotations

import difflib
import math
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypedDict
from urllib.parse import parse_qs, urlsplit

from tierserve.config import MAX_WEIGHT, MIN_WEIGHT, ConfigError, EngineConfig, load_raw, parse_config
from tierserve.server.http_limits import HttpLimits, parse_http_limits
from tierserve.tiers import Tier

MAX_TENANT_NAME = 64  # characters: the longest tenant name, in the config or x-tenant-id


class ApiDocsUrls(TypedDict):
    """FastAPI's settings for the API docs (`ServeConfig.api_docs_urls`)."""

    openapi_url: str | None
    docs_url: str | None
    redoc_url: str | None


@dataclass(frozen=True)
class RateLimit:
    """Token-bucket limits; None means that dimension is unlimited."""

    requests_per_s: float | None = None
    request_burst: float = 0.0  # bucket capacity in requests; 0 = one second's worth (at least 1)
    tokens_per_s: float | None = None
    token_burst: float = 0.0  # bucket capacity in tokens; 0 = one second's worth


@dataclass(frozen=True)
class TenantConfig:
    name: str
    api_keys: tuple[str, ...] = ()
    max_tier: Tier = Tier.P3  # the most urgent tier this tenant may use (deny by default: the lowest)
    default_tier: Tier = Tier.P1  # used when a request declares no tier (then capped by max_tier)
    weight: float = 1.0  # fair-share weight among tenants
    limit: RateLimit = field(default_factory=RateLimit)


@dataclass(frozen=True)
class RateLimitBackendConfig:
    backend: str = "memory"  # "memory" | "redis"
    redis_url: str = "redis://127.0.0.1:6379/0"
    fail_mode: str = "open"  # Redis unreachable: "open" = keep serving on local buckets; "closed" = reject
    redis_timeout_s: float = 0.05
    key_prefix: str = "tierserve"


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 1 << 20
    # The bytes of all bodies being uploaded at once; a body past it: 503 `busy` (body_limit.py).
    max_buffered_body_bytes: int = 64 << 20
    # Bodies over 64 KiB are parsed one at a time, for at most this share of the time, with
    # at most `large_body_queue` waiting (more get 503 `busy`), of which at most
    # `large_body_queue_per_tenant` of one tenant's (more get 429 `busy_tenant`), the time
    # shared fairly among tenants: body_gate.py.
    large_body_share: float = 0.1
    large_body_queue: int = 16
    large_body_queue_per_tenant: int = 4
    # A chat request's messages, at most (more get a 400 before the chat template runs).
    max_chat_messages: int = 512
    default_max_tokens: int = 512  # when a request gives none (capped by the context left)
    tenant_header: bool = False  # accept `x-tenant-id` to name a tenant without an API key
    default_tenant: str = "default"  # tenant of requests without a key, where those are allowed
    # Requests without a key on a server with declared tenants: refused at start-up unless true;
    # then they run as the default tenant, at its default tier at most.
    allow_anonymous: bool = False
    # Tenants share prefix-cache blocks (and learn from `cached_tokens` and the time to the
    # first token which prompts another sent): off by default, each tenant's cache is its own.
    share_prefix_cache_across_tenants: bool = False
    # The API's schema and its pages (/openapi.json, /docs, /redoc), which no key guards:
    # None = served unless the server requires API keys.
    api_docs: bool | None = None
    drain_timeout_s: float = 30.0
    # /ready answers 503 while the engine has had work and sent nothing for this long (a hung
    # or stopped engine process: no step ends); 0 = never. Keep it above the longest step.
    engine_stall_s: float = 60.0
    # /metrics (no key needed) is made at most this often and served from a cache meanwhile:
    # each one asks the engine process between two steps (metrics_cache.py); 0 = every scrape.
    metrics_max_age_s: float = 0.5
    ratelimit: RateLimitBackendConfig = field(default_factory=RateLimitBackendConfig)
    http: HttpLimits = field(default_factory=HttpLimits)


MAX_METRICS_AGE_S = 60.0
DEFAULT_QUEUE_CAPS: dict[Tier, int] = {Tier.P0: 256, Tier.P1: 2048, Tier.P2: 8192, Tier.P3: 8192}


@dataclass(frozen=True)
class LimitsConfig:
    global_limit: RateLimit = field(default_factory=RateLimit)
    queue_caps: Mapping[Tier, int] = field(default_factory=lambda: dict(DEFAULT_QUEUE_CAPS))


@dataclass(frozen=True)
class ServeConfig:
    server: ServerSettings = field(default_factory=ServerSettings)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    tenants: Mapping[str, TenantConfig] = field(default_factory=dict)
    engine: EngineConfig = field(default_factory=EngineConfig)
    source: str | None = None  # the file it came from; None = built-in defaults (open server)

    @property
    def has_keys(self) -> bool:
        """True when any tenant has API keys: then an unknown key gets 401."""
        return any(t.api_keys for t in self.tenants.values())

    @property
    def requires_key(self) -> bool:
        """True when a request without a key gets 401 (keys declared, anonymous not allowed)."""
        return self.has_keys and not self.server.allow_anonymous

    def api_docs_urls(self) -> ApiDocsUrls:
        """FastAPI's `openapi_url`, `docs_url` and `redoc_url`: None each where not served."""
        on = self.serves_api_docs
        return {
            "openapi_url": "/openapi.json" if on else None,
            "docs_url": "/docs" if on else None,
            "redoc_url": "/redoc" if on else None,
        }

    @property
    def serves_api_docs(self) -> bool:
        """/openapi.json, /docs and /redoc are served (they need no key): as set, else unless
        a key is required."""
        if self.server.api_docs is not None:
            return self.server.api_docs
        return not self.requires_key


def _table(path: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        # Its type, not its value: a tenant written as an array of tables printed its API keys.
        raise ConfigError(f"{path}: expected a table, got {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    """A value's TOML kind in words, for messages that must not print it (it may hold keys)."""
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    return f"a {type(value).__name__}"


def _reject_unknown(path: str, raw: Mapping[str, Any], known: tuple[str, ...]) -> None:
    for key in raw:
        if key not in known:
            raise ConfigError(f"{path}.{key}: unknown key (known: {', '.join(sorted(known))})")


def _number(path: str, value: Any, *, minimum: float, integer: bool = False, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if integer and not isinstance(value, int):
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if math.isnan(value) or math.isinf(value):
        raise ConfigError(f"{path}: must be finite, got {value!r}")
    if value < minimum or (strict and value == minimum):
        raise ConfigError(f"{path}: must be {'>' if strict else '>='} {minimum:g}, got {value!r}")
    return float(value)


def _string(path: str, value: Any, choices: tuple[str, ...] = ()) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{path}: expected a non-empty string, got {value!r}")
    if choices and value not in choices:
        raise ConfigError(f"{path}: expected one of {', '.join(choices)}, got {value!r}")
    return value


def _bool(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    return value


def _tier(path: str, value: Any) -> Tier:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{path}: expected a tier name or 0..3, got {value!r}")
    try:
        return Tier.parse(value)
    except ValueError as e:
        if isinstance(value, int):  # Tier(7)'s message names no valid value
            raise ConfigError(f"{path}: expected a tier name or 0..3, got {value}") from None
        raise ConfigError(f"{path}: {e}") from None


_RATE_KEYS = ("requests_per_s", "request_burst", "tokens_per_s", "token_burst")


def _rate_limit(path: str, raw: Mapping[str, Any]) -> RateLimit:
    """Read the rate keys of a table; a burst defaults to one second's worth (at least 1)."""
    values: dict[str, float | None] = {}
    for rate_key, burst_key in (("requests_per_s", "request_burst"), ("tokens_per_s", "token_burst")):
        rate = raw.get(rate_key)
        burst = raw.get(burst_key)
        if rate is None:
            if burst is not None:
                raise ConfigError(f"{path}.{burst_key}: set without {path}.{rate_key}")
            values[rate_key], values[burst_key] = None, 0.0
            continue
        r = _number(f"{path}.{rate_key}", rate, minimum=0.0, strict=True)
        b = max(1.0, r) if burst is None else _number(f"{path}.{burst_key}", burst, minimum=1.0)
        values[rate_key], values[burst_key] = r, b
    return RateLimit(
        requests_per_s=values["requests_per_s"],
        request_burst=values["request_burst"] or 0.0,
        tokens_per_s=values["tokens_per_s"],
        token_burst=values["token_burst"] or 0.0,
    )


REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


# Query options of a Redis URL the server leaves to redis-py; the others are refused: unknown
# names reached redis-py's connection as arguments (every request a 500), and its pool and
# timeout options overrode the server's own (`redis_timeout_s`, a pool of 64).
REDIS_URL_OPTIONS = (
    "db",
    "client_name",
    "health_check_interval",
    "protocol",
    "ssl_cert_reqs",
    "ssl_ca_certs",
    "ssl_ca_path",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_password",
    "ssl_check_hostname",
    "ssl_min_version",
    "ssl_ciphers",
)


def _redis_url(path: str, value: Any) -> str:
    url = _string(path, value)
    if not url.startswith(REDIS_SCHEMES):
        raise ConfigError(f"{path}: expected a URL starting {', '.join(REDIS_SCHEMES)}, got {url!r}")
    # redis-py reads a database it cannot parse as 0 (a typo shared database 0 with whatever
    # else uses it), a port of 0 as 6379, and a bad URL failed at start-up without naming
    # the setting.
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ConfigError(f"{path}: not a valid URL ({e}; a port is a number from 1 to 65535)") from None
    if port == 0:
        raise ConfigError(f"{path}: the port must be a number from 1 to 65535, got 0")
    query = parse_qs(parts.query, keep_blank_values=True)
    for name in query:
        if name not in REDIS_URL_OPTIONS:
            raise ConfigError(
                f"{path}: option {name!r} is not taken here (known: {', '.join(REDIS_URL_OPTIONS)}; "
                "the timeout is redis_timeout_s)"
            )
    databases = (
        query.get("db", []) if url.startswith("unix://") else [parts.path.lstrip("/"), *query.get("db", [])]
    )
    for database in databases:
        if database and not (database.isascii() and database.isdigit()):
            raise ConfigError(f"{path}: the database must be a number (0, 1, ...), got {database!r}")
    from redis.asyncio.connection import parse_url

    try:
        parse_url(url)
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None
    return url


def _ratelimit_backend(path: str, raw: Mapping[str, Any]) -> RateLimitBackendConfig:
    _reject_unknown(path, raw, ("backend", "redis_url", "fail_mode", "redis_timeout_s", "key_prefix"))
    base = RateLimitBackendConfig()
    return RateLimitBackendConfig(
        backend=_string(f"{path}.backend", raw.get("backend", base.backend), ("memory", "redis")),
        redis_url=_redis_url(f"{path}.redis_url", raw.get("redis_url", base.redis_url)),
        fail_mode=_string(f"{path}.fail_mode", raw.get("fail_mode", base.fail_mode), ("open", "closed")),
        redis_timeout_s=_number(
            f"{path}.redis_timeout_s",
            raw.get("redis_timeout_s", base.redis_timeout_s),
            minimum=0.0,
            strict=True,
        ),
        key_prefix=_string(f"{path}.key_prefix", raw.get("key_prefix", base.key_prefix)),
    )


def _server(raw: Mapping[str, Any]) -> ServerSettings:
    # The keys are the settings' names, the nested tables (`ratelimit`, `http`) included.
    _reject_unknown("server", raw, tuple(f.name for f in fields(ServerSettings)))
    base = ServerSettings()

    def whole(key: str) -> int:
        """A positive whole-number setting, its default where the file gives none."""
        return int(_number(f"server.{key}", raw.get(key, getattr(base, key)), minimum=1, integer=True))

    def flag(key: str) -> bool:
        """A true/false setting, its default where the file gives none."""
        return _bool(f"server.{key}", raw.get(key, getattr(base, key)))

    max_body, max_buffered = _body_sizes(raw, base, whole)
    queue, queue_per_tenant = _large_body_queues(raw, whole)
    return ServerSettings(
        host=_string("server.host", raw.get("host", base.host)),
        port=_port(raw.get("port", base.port)),
        max_body_bytes=max_body,
        max_buffered_body_bytes=max_buffered,
        large_body_share=_large_body_share(raw.get("large_body_share", base.large_body_share)),
        large_body_queue=queue,
        large_body_queue_per_tenant=queue_per_tenant,
        max_chat_messages=whole("max_chat_messages"),
        default_max_tokens=whole("default_max_tokens"),
        tenant_header=flag("tenant_header"),
        default_tenant=_string("server.default_tenant", raw.get("default_tenant", base.default_tenant)),
        allow_anonymous=flag("allow_anonymous"),
        share_prefix_cache_across_tenants=flag("share_prefix_cache_across_tenants"),
        api_docs=None if "api_docs" not in raw else _bool("server.api_docs", raw["api_docs"]),
        drain_timeout_s=_number(
            "server.drain_timeout_s", raw.get("drain_timeout_s", base.drain_timeout_s), minimum=0.0
        ),
        engine_stall_s=_number(
            "server.engine_stall_s", raw.get("engine_stall_s", base.engine_stall_s), minimum=0.0
        ),
        metrics_max_age_s=_metrics_max_age_s(raw.get("metrics_max_age_s", base.metrics_max_age_s)),
        ratelimit=_ratelimit_backend(
            "server.ratelimit", _table("server.ratelimit", raw.get("ratelimit", {}))
        ),
        http=parse_http_limits(_table("server.http", raw.get("http", {}))),
    )


def _metrics_max_age_s(raw: Any) -> float:
    age = _number("server.metrics_max_age_s", raw, minimum=0.0)
    if age > MAX_METRICS_AGE_S:  # Prometheus would read the same samples, scrape after scrape
        raise ConfigError(f"server.metrics_max_age_s: must be <= {MAX_METRICS_AGE_S:g} s, got {age:g}")
    return age


def _port(raw: Any) -> int:
    port = int(_number("server.port", raw, minimum=0, integer=True))
    if port > 65535:
        raise ConfigError(f"server.port: must be <= 65535, got {port}")
    return port


def _large_body_share(raw: Any) -> float:
    share = _number("server.large_body_share", raw, minimum=0.0, strict=True)
    if share > 1.0:
        raise ConfigError(f"server.large_body_share: a share of the time, at most 1, got {share:g}")
    return share


def _large_body_queues(raw: Mapping[str, Any], whole: Callable[[str], int]) -> tuple[int, int]:
    """`server.large_body_queue` and `large_body_queue_per_tenant`; unset, the second is the
    default (4) or the whole queue, whichever is less; set, it may not exceed the queue."""
    queue = whole("large_body_queue")
    per_tenant = whole("large_body_queue_per_tenant")
    if "large_body_queue_per_tenant" not in raw:
        return queue, min(per_tenant, queue)
    if per_tenant > queue:
        raise ConfigError(
            f"server.large_body_queue_per_tenant: at most server.large_body_queue ({queue}), got {per_tenant}"
        )
    return queue, per_tenant


def _body_sizes(raw: Mapping[str, Any], base: ServerSettings, whole: Callable[[str], int]) -> tuple[int, int]:
    """`server.max_body_bytes` and `max_buffered_body_bytes`; unset, the budget grows with a
    size limit raised past it, so that one body of the largest size always fits."""
    max_body = whole("max_body_bytes")
    if "max_buffered_body_bytes" not in raw:
        return max_body, max(base.max_buffered_body_bytes, max_body)
    max_buffered = whole("max_buffered_body_bytes")
    if max_buffered < max_body:
        raise ConfigError(
            f"server.max_buffered_body_bytes: {max_buffered} is under server.max_body_bytes ({max_body}): "
            "a body of the largest size could never be taken"
        )
    return max_body, max_buffered


def _limits(raw: Mapping[str, Any]) -> LimitsConfig:
    _reject_unknown("limits", raw, (*_RATE_KEYS, "queue_cap"))
    caps = dict(DEFAULT_QUEUE_CAPS)
    given: dict[Tier, str] = {}
    for name, value in _table("limits.queue_cap", raw.get("queue_cap", {})).items():
        tier = _tier(f"limits.queue_cap.{name}", name)
        if tier in given:
            raise ConfigError(
                f"limits.queue_cap.{name}: tier {tier.name} is given twice (also as {given[tier]})"
            )
        given[tier] = name
        caps[tier] = int(_number(f"limits.queue_cap.{name}", value, minimum=0, integer=True))
    return LimitsConfig(global_limit=_rate_limit("limits", raw), queue_caps=caps)


def _tenant(name: str, raw: Mapping[str, Any], seen_keys: dict[str, str]) -> TenantConfig:
    path = f"tenants.{name}"
    if not name or len(name) > MAX_TENANT_NAME or not name.isprintable():
        # As x-tenant-id must be: a tenant no header could name was accepted.
        shown = repr(name[:MAX_TENANT_NAME]) + ("..." if len(name) > MAX_TENANT_NAME else "")
        raise ConfigError(f"tenants.{shown}: a tenant name is 1..{MAX_TENANT_NAME} printable characters")
    _reject_unknown(path, raw, ("api_keys", "max_tier", "default_tier", "weight", *_RATE_KEYS))
    keys = raw.get("api_keys", [])
    if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys):
        got = "a list with an empty or non-string key" if isinstance(keys, list) else _kind(keys)
        raise ConfigError(f"{path}.api_keys: expected a list of non-empty strings, got {got}")
    for key in keys:
        if key != key.strip() or any(c != "\t" and unicodedata.category(c) == "Cc" for c in key):
            # No request could present it: the bearer token is read without the spaces
            # around it, and a header cannot carry a control character (a tab aside).
            raise ConfigError(
                f"{path}.api_keys: key {key[:6]!r}... has spaces at an end or a control character"
            )
        if key in seen_keys:
            where = "twice" if seen_keys[key] == name else f"also to tenant {seen_keys[key]!r}"
            raise ConfigError(f"{path}.api_keys: key {key[:6]}... is given {where}")
        seen_keys[key] = name
    max_tier = _tier(f"{path}.max_tier", raw.get("max_tier", "P3"))
    default_tier = _tier(f"{path}.default_tier", raw.get("default_tier", "P1"))
    if "default_tier" in raw and default_tier < max_tier:
        # The default would always be lowered to max_tier without a word, also to the P3 of a
        # tenant whose max_tier the file leaves out (deny by default).
        implicit = "" if "max_tier" in raw else " (its default: set it too)"
        raise ConfigError(
            f"{path}.default_tier: {default_tier.name} is above the tenant's max_tier "
            f"{max_tier.name}{implicit}"
        )
    return TenantConfig(
        name=name,
        api_keys=tuple(keys),
        max_tier=max_tier,
        default_tier=default_tier,
        weight=_weight(f"{path}.weight", raw.get("weight", 1.0)),
        limit=_rate_limit(path, raw),
    )


def _weight(path: str, value: Any) -> float:
    """A tenant's fair-share weight, in the bounds of a tier's (a weight of 1e-320 made a
    request's cost infinite, and the tier's fair queue first come, first served for good)."""
    weight = _number(path, value, minimum=0.0, strict=True)
    if not MIN_WEIGHT <= weight <= MAX_WEIGHT:
        raise ConfigError(f"{path}: must be in [{MIN_WEIGHT:g}, {MAX_WEIGHT:g}], got {value!r}")
    return weight


def _check_default_tenant(name: str, tenants: Mapping[str, TenantConfig]) -> None:
    """A `default_tenant` the file names must be one it declares: a misspelt name ran the
    anonymous requests as a tenant of its own, with none of the declared one's limits."""
    if name == ServerSettings.default_tenant or not tenants or name in tenants:
        return  # the built-in name needs no declaring: a tenant of its own, at P3
    close = difflib.get_close_matches(name, list(tenants), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(
        f"server.default_tenant: {name!r} is not a declared tenant{hint}; declare [tenants.{name}] "
        "(it may have no api_keys) or leave default_tenant out"
    )


def parse_serve_config(raw: Mapping[str, Any], source: str | None = None) -> ServeConfig:
    """Validate a whole parsed TOML document (engine sections included)."""
    engine = parse_config(raw)
    server = _server(_table("server", raw.get("server", {})))
    limits = _limits(_table("limits", raw.get("limits", {})))
    tenants: dict[str, TenantConfig] = {}
    seen_keys: dict[str, str] = {}
    for name, body in _table("tenants", raw.get("tenants", {})).items():
        tenants[name] = _tenant(name, _table(f"tenants.{name}", body), seen_keys)
    _check_default_tenant(server.default_tenant, tenants)
    if tenants and not any(t.api_keys for t in tenants.values()) and not server.allow_anonymous:
        raise ConfigError(
            "tenants: declared, but none has api_keys: anyone could pick any tenant. Give tenants "
            "api_keys, or set server.allow_anonymous = true to serve requests without a key "
            "(they run as the default tenant, at its default tier at most)"
        )
    return ServeConfig(server=server, limits=limits, tenants=tenants, engine=engine, source=source)


def load_serve_config(path: str | Path | None) -> ServeConfig:
    """Load and validate `path`; None gives the built-in open configuration."""
    if path is None:
        return ServeConfig()
    return parse_serve_config(load_raw(path), source=str(path))
