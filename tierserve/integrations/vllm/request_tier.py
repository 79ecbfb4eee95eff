"""Which tier and tenant a vLLM request belongs to.

A request names its tier in `vllm_xargs` (`{"tier": "P0", "tenant": "acme"}`; vLLM hands
them to the engine as `SamplingParams.extra_args`), or else through its `priority`, mapped
by the config. Malformed arguments raise `TierArgsError`, whose message the HTTP server
returns with a 400 (see `validator.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tierserve.integrations.vllm.plugin_config import PluginConfig
from tierserve.tiers import Tier

XARG_TIER = "tier"
XARG_TENANT = "tenant"
DEFAULT_TENANT = "default"
MAX_TENANT_CHARS = 128
# A tier names one of four tiers in a few characters; anything longer is echoed back
# shortened, so a 400 (and the log line beside it) stays one short line whatever was sent.
MAX_ECHO_CHARS = 40


class TierArgsError(ValueError):
    """A request's tier or tenant arguments are malformed."""


def _echo(value: Any) -> str:
    """`value`'s repr for an error message, cut to MAX_ECHO_CHARS characters."""
    text = repr(value)
    return text if len(text) <= MAX_ECHO_CHARS else f"{text[:MAX_ECHO_CHARS]}... ({len(text)} characters)"


@dataclass(frozen=True)
class TierLabel:
    tier: Tier
    tenant: str


def _tier_arg(value: Any) -> Tier:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TierArgsError(f"vllm_xargs.{XARG_TIER}: expected a tier name or number, got {_echo(value)}")
    try:
        return Tier.parse(value)
    except ValueError:
        names = ", ".join(f"{t.name}/{t.label}/{int(t)}" for t in Tier)
        raise TierArgsError(
            f"vllm_xargs.{XARG_TIER}: unknown tier {_echo(value)}; expected one of {names}"
        ) from None


def _tenant_arg(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise TierArgsError(f"vllm_xargs.{XARG_TENANT}: expected a non-empty string, got {_echo(value)}")
    if len(value) > MAX_TENANT_CHARS:
        raise TierArgsError(f"vllm_xargs.{XARG_TENANT}: longer than {MAX_TENANT_CHARS} characters")
    return value


def label_request(priority: int, extra_args: Mapping[str, Any] | None, config: PluginConfig) -> TierLabel:
    """The request's tier (xargs first, then its priority) and tenant; raises `TierArgsError`."""
    args = extra_args or {}
    tier = _tier_arg(args[XARG_TIER]) if XARG_TIER in args else config.tier_for_priority(priority)
    tenant = _tenant_arg(args[XARG_TENANT]) if XARG_TENANT in args else DEFAULT_TENANT
    return TierLabel(tier, tenant)
