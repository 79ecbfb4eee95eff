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

import difflib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from tierserve.config import ConfigError, EngineConfig, load_raw, parse_config
from tierserve.integrations.vllm.ledger import tier_turned_off
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
    source: str = "the plug-in's defaults"  # where it came from, for errors found later
    # Settings the config gives that vLLM's own flags decide, each with the flag to use.
    ignored: tuple[str, ...] = ()

    def tier_for_priority(self, priority: int) -> Tier:
        """The mapped tier; an unmapped priority past every mapped one and vLLM's default 0
        takes the tier of the nearest such end (vLLM runs lower values first: a background
        job's priority 10 ran as P1, ahead of 1's P2 and 2's P3), where 0, unless mapped,
        stands for `default_tier` (an untagged request's: a table of `-1 = "P0"` alone must
        not run untagged traffic as realtime); between them, `default_tier`."""
        tiers = self.priority_tiers
        if priority in tiers:
            return tiers[priority]
        least, greatest = min((*tiers, 0)), max((*tiers, 0))
        if priority < least:
            return tiers.get(least, self.default_tier)
        if priority > greatest:
            return tiers.get(greatest, self.default_tier)
        return self.default_tier


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
        # TOML and JSON keys are strings; a Python dict passed to LLM(...) may hold ints.
        plain_int = isinstance(key, int) and not isinstance(key, bool)
        if not plain_int and not (isinstance(key, str) and _PRIORITY_KEY.fullmatch(key)):
            raise ConfigError(
                f"vllm.priority.{key}: the key must be an integer priority, such as 0 or -1 "
                '(or "0", "-1": TOML and JSON keys are strings)'
            )
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
    tiered = POLICIES[policy].tiered_memory
    engine = parse_config(body, tiers_may_be_off=not tiered)  # the plug-in refuses a ceiling of 0
    for tier in ALL_TIERS if tiered else ():
        if engine.tiers[tier].ceiling == 0:
            raise tier_turned_off(tier)
    return PluginConfig(engine, policy, priorities, default_tier, ignored=_vllm_decides(raw))


# [scheduler] keys that configure tierserve's own engine, and what decides each inside vLLM
# (the policies read the rest: `drr_quantum_tokens`).
_VLLM_DECIDES = {
    "max_num_seqs": "its --max-num-seqs sets it",
    "max_num_batched_tokens": "its --max-num-batched-tokens sets it",
    "enable_prefix_caching": "its --enable-prefix-caching / --no-enable-prefix-caching sets it",
    "swap_factor": "vLLM preempts by recomputing (its KV offloading aside)",
    "long_prompt_tokens": "its --long-prefill-token-threshold chunks long prompts",
    "long_prompt_chunk_tokens": "its --long-prefill-token-threshold chunks long prompts",
}


def _vllm_decides(raw: Mapping[str, Any]) -> tuple[str, ...]:
    """A note for each setting in `raw` that the plug-in does not read (a config shared with
    `tierserve serve` may hold them): accepted without a word, they read as if they applied."""
    scheduler = raw.get("scheduler")
    if not isinstance(scheduler, Mapping):
        return ()
    return tuple(
        f"scheduler.{key} is not read inside vLLM: {what}"
        for key, what in _VLLM_DECIDES.items()
        if key in scheduler
    )


# vLLM's additional config, as `vllm serve` and `LLM(...)` users each write it.
INLINE_SOURCE = f"--additional-config / additional_config {ADDITIONAL_CONFIG_KEY!r}"


def load_plugin_config(
    additional_config: Mapping[str, Any] | None, environ: Mapping[str, str] = os.environ
) -> PluginConfig:
    """The configuration from $TIERSERVE_CONFIG or vLLM's additional config, else the defaults."""
    path = environ.get(CONFIG_ENV)
    extra = additional_config or {}
    inline = extra.get(ADDITIONAL_CONFIG_KEY)
    if path and inline is not None:
        raise ConfigError(f"both ${CONFIG_ENV} ({path}) and {INLINE_SOURCE} are set; use one")
    if path:
        try:
            raw = load_raw(path)  # its errors name the file
        except ConfigError as e:
            raise ConfigError(f"${CONFIG_ENV}: {e}") from None
        return _parse_from(f"${CONFIG_ENV} ({path})", raw)
    if ADDITIONAL_CONFIG_KEY in extra:
        if not isinstance(inline, Mapping):
            raise ConfigError(
                f"additional_config.{ADDITIONAL_CONFIG_KEY}: expected a JSON object, got {inline!r}"
            )
        return _parse_from(INLINE_SOURCE, inline)
    _check_unwrapped(extra)
    return PluginConfig()


# additional_config is shared with vLLM and its other plug-ins: only keys no one else would
# use ("scheduler" and "policy" are too general) are taken for the plug-in's tables.
_OWN_TABLES = ("tiers", "vllm")


def _check_unwrapped(extra: Mapping[str, Any]) -> None:
    """With no config given (the defaults would run), refuse the plug-in's tables written
    beside its key instead of under it, and a key that looks like a misspelling of it: either
    ran the defaults without a word."""
    ours = [key for key in extra if key in _OWN_TABLES]
    if ours:
        raise ConfigError(
            f"additional_config: {', '.join(ours)} at its top level; the plug-in reads its tables under "
            f'"{ADDITIONAL_CONFIG_KEY}": {{"{ADDITIONAL_CONFIG_KEY}": {{"{ours[0]}": ...}}}}'
        )
    near = difflib.get_close_matches(ADDITIONAL_CONFIG_KEY, [str(k) for k in extra], n=1, cutoff=0.8)
    if near:
        raise ConfigError(
            f"additional_config: {near[0]!r} is not read; did you mean {ADDITIONAL_CONFIG_KEY!r}?"
        )


def _parse_from(source: str, raw: Mapping[str, Any]) -> PluginConfig:
    """`parse_plugin_config`, its errors prefixed by where the config came from: the check
    runs in vLLM's engine core, whose log says nothing of which file or flag was read."""
    try:
        return replace(parse_plugin_config(raw), source=source)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
