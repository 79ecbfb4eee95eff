"""Who is calling and at which tier: API key or `x-tenant-id` -> tenant -> effective tier.

A declared tier more urgent than the tenant's entitlement is lowered to it, never raised.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace

from starlette.datastructures import Headers

from tierserve.server.config import MAX_TENANT_NAME, ServeConfig, TenantConfig
from tierserve.server.errors import bad_request, unauthorized
from tierserve.tiers import Tier


@dataclass(frozen=True, slots=True)
class TierDecision:
    declared: Tier | None  # what the request asked for (None: nothing, the tenant default applied)
    effective: Tier  # the tier it runs at
    entitled: Tier  # the most urgent tier its tenant may use

    @property
    def lowered(self) -> bool:
        return self.declared is not None and self.effective != self.declared


class TenantResolver:
    """Maps credentials to a `TenantConfig`; raises `ApiError` (401/400) when it cannot.

    A known API key names its tenant; an unknown one is a 401. Without a key: `x-tenant-id`
    names a declared tenant only where `server.tenant_header` trusts it; otherwise the request
    is anonymous: a 401 where keys are required, the default tenant capped at its default tier
    where `allow_anonymous` is set, and an ad-hoc tenant named by `x-tenant-id` on an open
    server (one that declares no tenants).
    """

    def __init__(self, config: ServeConfig) -> None:
        self._config = config
        self._by_key = {key: t for t in config.tenants.values() for key in t.api_keys}
        self._requires_key = config.requires_key
        self._open = not config.tenants
        name = config.server.default_tenant
        if self._open:
            self._anonymous = TenantConfig(name=name, max_tier=Tier.P0)
        else:
            declared = config.tenants.get(name)
            base = declared or TenantConfig(name=name, default_tier=Tier.P3)
            self._anonymous = replace(base, max_tier=max(base.max_tier, base.default_tier))

    @property
    def requires_key(self) -> bool:
        return self._requires_key

    @property
    def anonymous(self) -> TenantConfig:
        return self._anonymous

    def cache_salt(self, tenant: TenantConfig, salt: str | None) -> str | None:
        """The engine's prefix-cache salt for a request of `tenant` that sent `salt` (vLLM's
        `cache_salt`): one of its own for each tenant, so that no tenant gets `cached_tokens`
        (or a faster first token) for blocks of another's prompts, unless the server is set
        to `share_prefix_cache_across_tenants`. Requests without a key (the anonymous
        tenant) share among themselves, unsalted (None) where they send no salt, and so do
        the ad-hoc tenants of an open server: anyone may send any `x-tenant-id` there, so
        apart they would lose each other's cache hits and hide nothing."""
        shared = (
            self._open or tenant is self._anonymous or self._config.server.share_prefix_cache_across_tenants
        )
        if shared and salt is None:
            return None
        # The pair as one string that no other pair gives, whatever salt a client sends.
        return json.dumps([None if shared else tenant.name, salt])

    def resolve_headers(self, headers: Headers) -> TenantConfig:
        """`resolve` on a request's headers; a 400 where one of them comes twice, differing."""
        return self.resolve(one_header(headers, "authorization"), one_header(headers, "x-tenant-id"))

    def resolve(self, authorization: str | None, tenant_header: str | None) -> TenantConfig:
        if tenant_header is not None:
            tenant_header = header_text(tenant_header)
            _check_tenant_name(tenant_header)
        key = _bearer(authorization)
        if self._by_key and not key and authorization is not None and authorization.strip():
            # A key sent without its scheme ("sk-...", "Basic sk-...") is not anonymous: under
            # allow_anonymous it ran, silently, at the anonymous tier.
            raise unauthorized("Authorization must be 'Bearer <key>'.")
        if key and self._by_key:
            # As sent (Latin-1, as the ASGI server decodes headers), else read as UTF-8: a key
            # "clé" sent as UTF-8 arrives as "clÃ©".
            tenant = self._by_key.get(key) or self._by_key.get(header_text(key))
            if tenant is None:
                raise unauthorized("Incorrect API key provided.")
            return tenant
        if tenant_header is not None and self._config.server.tenant_header and not self._open:
            named = self._config.tenants.get(tenant_header)
            if named is not None:
                return named
            if self._requires_key:
                raise unauthorized(f"Unknown tenant {_shown(tenant_header)} in x-tenant-id.")
        if self._requires_key:
            raise unauthorized("Missing API key: send 'Authorization: Bearer <key>'.")
        if self._open and tenant_header is not None:
            # Open server: x-tenant-id labels an ad-hoc tenant (for fair sharing only).
            return TenantConfig(name=tenant_header, max_tier=Tier.P0)
        return self._anonymous


def one_header(headers: Headers, name: str, meaning: Callable[[str], object] = str) -> str | None:
    """The value of a header a request names one thing by (its key, tenant or tier): None when
    absent, and a 400 naming it when it comes more than once meaning different things (by
    `meaning`: the text itself, or for the tier the tier). Reading the first would let
    whichever proxy or client added one more decide silently."""
    values = headers.getlist(name)
    if any(meaning(v) != meaning(values[0]) for v in values[1:]):
        raise bad_request(f"{name}: sent {len(values)} times with different values; send it once", name)
    return values[0] if values else None


def tier_header(headers: Headers) -> str | None:
    """`x-request-tier`, sent once or naming one tier each time (`P0`, `p0` and `realtime`)."""
    return one_header(headers, "x-request-tier", _tier_named)


def _tier_named(value: str) -> object:
    """The tier `value` names, or `value` itself where it names none (refused later)."""
    try:
        return Tier.parse(value)
    except ValueError:
        return value


def _bearer(authorization: str | None) -> str:
    if not authorization:
        return ""
    scheme, _, value = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return ""
    return value.strip()


def header_text(value: str) -> str:
    """A header value as its sender wrote it. HTTP headers are bytes; the ASGI server hands
    them over decoded as Latin-1, so UTF-8 text ("café") arrives as mojibake ("cafÃ©").
    Bytes that are not UTF-8 stay as they came."""
    try:
        return value.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return value


def _shown(value: str, limit: int = MAX_TENANT_NAME) -> str:
    """`value` for an error message: quoted, and cut short (a header may be 32 KiB)."""
    if len(value) <= limit:
        return repr(value)
    return repr(value[:limit]) + f" (+{len(value) - limit} characters)"


def _check_tenant_name(name: str) -> None:
    if not name or len(name) > MAX_TENANT_NAME or not name.isprintable():
        raise bad_request(f"x-tenant-id must be 1..{MAX_TENANT_NAME} printable characters", "x-tenant-id")


def parse_declared_tier(header: str | None, priority: int | None) -> Tier | None:
    """The tier a request declares: the `x-request-tier` header wins over the body's `priority`."""
    if header is not None:
        header = header_text(header)
        try:
            return Tier.parse(header)
        except ValueError:
            names = ", ".join(f"{t.name}/{t.label}" for t in Tier)
            raise bad_request(
                f"x-request-tier: unknown tier {_shown(header)}; expected one of {names}", "x-request-tier"
            ) from None
    if priority is not None:
        if not 0 <= priority <= 3:
            raise bad_request(f"priority must be 0..3, got {priority}", "priority")
        return Tier(priority)
    return None


def decide_tier(tenant: TenantConfig, declared: Tier | None) -> TierDecision:
    wanted = tenant.default_tier if declared is None else declared
    # A larger Tier value is less urgent: cap at the entitlement by taking the max.
    return TierDecision(declared=declared, effective=max(wanted, tenant.max_tier), entitled=tenant.max_tier)
