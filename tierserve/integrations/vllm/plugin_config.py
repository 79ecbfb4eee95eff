"""The plug-in's configuration: tierserve's own TOML (tiers, scheduler) plus a `[vllm]` table.

    [vllm]
    policy = "hybrid"          # any tierserve policy name
    default_tier = "P1"        # requests that name no tier and whose priority is unmapped
    [vllm.priority]            # vLLM request priority -> tier (the default below)
    -1 = "P0"
    1 = "P2"
    2 = "P3"

vLLM gives every request priority 0 unless told otherwise, and schedules a lower value
first; so by default 0 is unmapped (an untagged request gets `default_tier`), -1 is P0,
and 1 and 2 are P2 and P3: the tier number less one. (Mapping 0 to P0 ran every untagged
request as realtime, held to P0's ceiling.)

It comes from the TOML file named by $TIERSERVE_CONFIG, or from vLLM's extra config
(`--additional-config '{"tierserve": {...}}'`, the same tables as JSON); naming both is an
error. Every value is checked here, before the engine starts; errors name the field.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tierserve.config import ConfigError, EngineConfig, load_raw, parse_config
from tierserve.scheduling import POLICIES
from tierserve.tiers import ALL_TIERS, Tier

CONFIG_ENV = "TIERSERVE_CONFIG"
ADDITIONAL_CONFIG_KEY = "tierserve"
_VLLM_KEYS = ("policy", "default_tier", "priority")
_PRIORITY_KEY = re.compile(r"-?[0-9]+")  # what vLLM's `priority` is: a plain integer
# The tables the plug-in reads; the server's ([server], [tenants], [limits]) configure
# tierserve's own HTTP layer, which vLLM's replaces.
_SECTIONS = ("vllm", "scheduler", "tiers", "policy")


def _default_priorities() -> dict[int, Tier]:
    """The tier number less one; vLLM's default 0 is left to `default_tier`."""
    return {int(t) - 1: t for t in ALL_TIERS if t is not Tier.P1}


@dataclass(frozen=True)
class PluginConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    policy: str = "hybrid"
    priority_tiers: Mapping[int, Tier] = field(default_factory=_default_priorities)
    default_tier: Tier = Tier.P1

    def tier_for_priority(self, priority: int) -> Tier:
        return self.priority_tiers.get(priority, self.default_tier)


def _parse_tier(path: str, value: Any) -> Tier:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ConfigError(f"{path}: expected a tier name or number, got {value!r}")
    try:
        return Tier.parse(value)
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None


def _parse_priorities(raw: Any) -> dict[int, Tier]:
    if not isinstance(raw, Mapping):
        raise ConfigError("vllm.priority: expected a table of priority = tier")
    out: dict[int, Tier] = {}
    for key, value in raw.items():
        # int() alone would also take " 1 " and "1_0" (as 10); a priority is written plainly.
        if not isinstance(key, str) or not _PRIORITY_KEY.fullmatch(key):
            raise ConfigError(f"vllm.priority.{key}: the key must be an integer priority, such as 0 or -1")
        priority = int(key)
        if priority in out:
            raise ConfigError(f"vllm.priority.{key}: priority {priority} is given twice")
        out[priority] = _parse_tier(f"vllm.priority.{key}", value)
    return out


def parse_plugin_config(raw: Mapping[str, Any]) -> PluginConfig:
    for key in raw:
        if key not in _SECTIONS:
            raise ConfigError(
                f"{key}: not read by the vLLM plug-in (it reads {', '.join(f'[{k}]' for k in _SECTIONS)}; "
                "a request's tenant comes in vllm_xargs.tenant)"
            )
    body = dict(raw)
    vllm = body.pop("vllm", {})
    if not isinstance(vllm, Mapping):
        raise ConfigError("vllm: expected a table")
    for key in vllm:
        if key not in _VLLM_KEYS:
            raise ConfigError(f"vllm.{key}: unknown key (known: {', '.join(_VLLM_KEYS)})")
    policy = vllm.get("policy", "hybrid")
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ConfigError(f"vllm.policy: unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    priorities = _parse_priorities(vllm["priority"]) if "priority" in vllm else _default_priorities()
    default_tier = _parse_tier("vllm.default_tier", vllm.get("default_tier", "P1"))
    return PluginConfig(parse_config(body), policy, priorities, default_tier)


# vLLM's additional config, as `vllm serve` and `LLM(...)` users each write it.
INLINE_SOURCE = f"--additional-config / additional_config {ADDITIONAL_CONFIG_KEY!r}"


def load_plugin_config(
    additional_config: Mapping[str, Any] | None, environ: Mapping[str, str] = os.environ
) -> PluginConfig:
    """The configuration from $TIERSERVE_CONFIG or vLLM's additional config, else the defaults."""
    path = environ.get(CONFIG_ENV)
    inline = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
    if path and inline is not None:
        raise ConfigError(f"both ${CONFIG_ENV} ({path}) and {INLINE_SOURCE} are set; use one")
    if path:
        raw = load_raw(path)  # its errors name the file already
        return _parse_from(f"${CONFIG_ENV} ({path})", raw)
    if inline is not None:
        if not isinstance(inline, Mapping):
            raise ConfigError(f"additional_config.{ADDITIONAL_CONFIG_KEY}: expected a JSON object")
        return _parse_from(INLINE_SOURCE, inline)
    return PluginConfig()


def _parse_from(source: str, raw: Mapping[str, Any]) -> PluginConfig:
    """`parse_plugin_config`, its errors prefixed by where the config came from: the check
    runs in vLLM's engine core, whose log says nothing of which file or flag was read."""
    try:
        return parse_plugin_config(raw)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
