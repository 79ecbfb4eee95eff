"""Engine configuration: tiers, memory partition and scheduler limits, from TOML.

Every value is validated when the file is loaded, before anything runs; an error names
the offending field (e.g. ``tiers.P1.ceiling``). Config objects are frozen and do no I/O.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar

from tierserve.tiers import ALL_TIERS, Tier

MIN_WEIGHT, MAX_WEIGHT = 1e-6, 1e6  # a tier's wfq_weight and drr_weight

OptionsT = TypeVar("OptionsT", bound="PolicyOptions")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


@dataclass(frozen=True)
class TierConfig:
    ttft_target_s: float  # P95 target; inf = none
    wfq_weight: float
    drr_weight: float
    aging_s: float  # a waiting request older than this moves ahead of the fair order; inf = never
    floor: float  # fraction of KV blocks only this tier or a more urgent one may use
    reserve: float  # fraction kept for this tier, lent to others while idle, reclaimed on need
    ceiling: float  # most of the KV blocks this tier may hold
    expected_output_tokens: int  # cost hint when a request gives none


DEFAULT_TIERS: dict[Tier, TierConfig] = {
    # Targets and shares: docs/design.md §1. Weights: the source article (WFQ 16/8/4/2, DRR
    # 8/4/2/1). Floors/reserves/ceilings: docs/design.md §4. Aging: only P3 ages by default (the
    # article's 5 s). P1-P2 are served by fair queuing, which already bounds their wait; the
    # article's 30 s / 15 s thresholds would, under overload, turn the order into
    # first-come-first-served across tiers, and the P1 target into P2's.
    Tier.P0: TierConfig(0.5, 16.0, 8.0, math.inf, 0.15, 0.0, 0.40, 256),
    Tier.P1: TierConfig(5.0, 8.0, 4.0, math.inf, 0.0, 0.30, 1.0, 256),
    Tier.P2: TierConfig(60.0, 4.0, 2.0, math.inf, 0.0, 0.0, 1.0, 64),
    Tier.P3: TierConfig(math.inf, 2.0, 1.0, 5.0, 0.0, 0.0, 1.0, 512),
}


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 8192  # token budget of one step (decodes + prefill chunks)
    max_num_seqs: int = 256  # running sequences at most
    long_prompt_tokens: int = 8192  # a P1-or-lower prompt longer than this is chunked to...
    long_prompt_chunk_tokens: int = 4096  # ...at most this many tokens per step
    # Swap when one-way swap time < factor * prefill time, else recompute. 0.5: whichever
    # costs less, counting the blocks' way out and back in against prefilling them again.
    swap_factor: float = 0.5
    drr_quantum_tokens: int = 2048  # token-cost DRR: tokens per unit of weight per round
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class PolicyOptions:
    """A policy's own settings: the `[policy.NAME]` table of the config file.

    A policy that has settings names a frozen subclass (its `options_type`); every field
    has a default, and `check` raises ConfigError naming the field of a bad value.
    """

    def check(self, path: str) -> None:
        """Raise ConfigError for a bad value; `path` is e.g. ``policy.hybrid``."""


@dataclass(frozen=True)
class EngineConfig:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    tiers: Mapping[Tier, TierConfig] = field(default_factory=lambda: dict(DEFAULT_TIERS))
    policy_options: Mapping[str, PolicyOptions] = field(default_factory=dict)  # by policy name

    def tier(self, tier: Tier) -> TierConfig:
        return self.tiers[tier]

    def options(self, name: str, options_type: type[OptionsT]) -> OptionsT:
        """Policy `name`'s settings, or the defaults where the config gives none."""
        found = self.policy_options.get(name)
        return found if isinstance(found, options_type) else options_type()


def _check_number(path: str, value: Any, *, integer: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if integer and not isinstance(value, int):
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if isinstance(value, float) and math.isnan(value):
        raise ConfigError(f"{path}: NaN is not allowed")
    return float(value)


def _merge(path: str, base: Any, raw: Mapping[str, Any]) -> Any:
    """Return `base` (a dataclass) with the fields in `raw` replaced, type-checked."""
    known = {f.name: f for f in fields(base)}
    changes: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in known:
            raise ConfigError(f"{path}.{key}: unknown key (known: {', '.join(sorted(known))})")
        current = getattr(base, key)
        if isinstance(current, bool):
            if not isinstance(value, bool):
                raise ConfigError(f"{path}.{key}: expected true or false, got {value!r}")
            changes[key] = value
        elif isinstance(current, int):
            changes[key] = int(_check_number(f"{path}.{key}", value, integer=True))
        else:
            changes[key] = _check_number(f"{path}.{key}", value)
    return replace(base, **changes)


def validate(config: EngineConfig, *, tiers_may_be_off: bool = True) -> EngineConfig:
    """`config` if every value is in range (ConfigError naming the field if not): the
    scheduler's limits, each tier's settings, then how the tiers' shares of the cache add up."""
    s = config.scheduler
    for name in (
        "max_num_batched_tokens",
        "max_num_seqs",
        "long_prompt_tokens",
        "long_prompt_chunk_tokens",
        "drr_quantum_tokens",
    ):
        if getattr(s, name) < 1:
            raise ConfigError(f"scheduler.{name}: must be >= 1, got {getattr(s, name)}")
    if s.swap_factor < 0:
        raise ConfigError(f"scheduler.swap_factor: must be >= 0, got {s.swap_factor}")
    for tier in ALL_TIERS:
        if tier not in config.tiers:
            raise ConfigError(f"tiers.{tier.name}: missing")
        _check_tier(tier, config.tiers[tier])
    _check_shares(config.tiers, tiers_may_be_off)
    return config


def _check_tier(tier: Tier, t: TierConfig) -> None:
    p = f"tiers.{tier.name}"
    for name in ("wfq_weight", "drr_weight"):
        # Relative shares: past these a ratio means nothing, and a weight of 1e-320 made
        # DRR's deficit round loop run forever (cost / quantum overflowed to inf).
        if not MIN_WEIGHT <= getattr(t, name) <= MAX_WEIGHT:
            raise ConfigError(
                f"{p}.{name}: must be in [{MIN_WEIGHT:g}, {MAX_WEIGHT:g}], got {getattr(t, name)}"
            )
    for name in ("ttft_target_s", "aging_s"):
        if getattr(t, name) <= 0:
            raise ConfigError(f"{p}.{name}: must be > 0, got {getattr(t, name)}")
    for name in ("floor", "reserve", "ceiling"):
        if not 0 <= getattr(t, name) <= 1:
            raise ConfigError(f"{p}.{name}: must be a fraction in [0, 1], got {getattr(t, name)}")
    if t.ceiling < t.floor + t.reserve - 1e-9:  # 0.1 + 0.2 is 0.30000000000000004
        # The defaults named, not guessed at: a ceiling set to its default value was said to
        # be unset, while the culprit was the default reserve the file did not set.
        d = DEFAULT_TIERS[tier]
        raise ConfigError(
            f"{p}.ceiling: {t.ceiling} is below floor + reserve ({t.floor} + {t.reserve}): raise the "
            f"ceiling or lower the floor or the reserve ({tier.name}'s defaults, for any not set: "
            f"floor {d.floor}, reserve {d.reserve}, ceiling {d.ceiling})"
        )
    if t.expected_output_tokens < 1:
        raise ConfigError(f"{p}.expected_output_tokens: must be >= 1")


def _check_shares(tiers: Mapping[Tier, TierConfig], tiers_may_be_off: bool = True) -> None:
    """Floors and reserves within the cache, and room left for every tier that may hold any
    (`tiers_may_be_off`: a ceiling of 0 is offered as a way out; the vLLM plug-in refuses it)."""
    total = sum(tiers[t].floor + tiers[t].reserve for t in ALL_TIERS)
    if total > 1 + 1e-9:
        parts = ", ".join(
            f"{t.name} {tiers[t].floor + tiers[t].reserve:.0%}"
            for t in ALL_TIERS
            if tiers[t].floor + tiers[t].reserve
        )
        # A tier the file does not name keeps its default share, which the sum counts too.
        raise ConfigError(
            f"tiers: floors and reserves add up to {total:.0%}, over 100% ({parts}; a tier not "
            "set keeps its default floor and reserve)"
        )
    above = 0.0  # the floors of the more urgent tiers, which a tier's allocations leave free
    for tier in ALL_TIERS:
        if tiers[tier].ceiling > 0 and above >= 1 - 1e-9:
            # Every request of it was refused, blamed on its max_tokens; a ceiling of 0 is
            # the way to turn a tier off.
            off = ", or set its ceiling to 0 to turn it off" if tiers_may_be_off else ""
            raise ConfigError(
                f"tiers.{tier.name}: the floors of the more urgent tiers take the whole KV cache "
                f"({above:.0%}), so it could hold no block; lower them{off}"
            )
        above += tiers[tier].floor


# Top-level tables that belong to other layers (the server validates them itself).
FOREIGN_SECTIONS = ("server", "tenants", "limits")


def _parse_policy_options(raw: Any) -> dict[str, PolicyOptions]:
    from tierserve.scheduling.registry import POLICIES  # the registry imports this module

    if not isinstance(raw, Mapping):
        raise ConfigError("policy: expected a table of [policy.NAME] tables")
    parsed: dict[str, PolicyOptions] = {}
    for name, body in raw.items():
        path = f"policy.{name}"
        if name not in POLICIES:
            raise ConfigError(f"{path}: unknown policy (known: {', '.join(POLICIES)})")
        options_type = POLICIES[name].options_type
        if options_type is None:
            raise ConfigError(f"{path}: policy {name!r} has no settings")
        if not isinstance(body, Mapping):
            raise ConfigError(f"{path}: expected a table")
        options = _merge(path, options_type(), body)
        options.check(path)
        parsed[name] = options
    return parsed


# Settings that moved from [scheduler] to the hybrid policy's own table.
MOVED_TO_HYBRID = {
    "p0_step_tokens": "p0_step_tokens",
    "p0_solo_prefill": "p0_solo_prefill",
    "p3_yields": "p3_yields",
    "p0_guard_s": "p0_likely_s",
}


def parse_config(raw: Mapping[str, Any], *, tiers_may_be_off: bool = True) -> EngineConfig:
    allowed = ("scheduler", "tiers", "policy", *FOREIGN_SECTIONS)
    for key in raw:
        if key not in allowed:
            raise ConfigError(f"{key}: unknown section (known: {', '.join(allowed)})")
    raw_scheduler = raw.get("scheduler", {})
    if not isinstance(raw_scheduler, Mapping):
        raise ConfigError("scheduler: expected a table")
    for key in raw_scheduler:
        if key in MOVED_TO_HYBRID:
            raise ConfigError(
                f"scheduler.{key}: moved to the hybrid policy's own table; write it as "
                f"[policy.hybrid] {MOVED_TO_HYBRID[key]} = ... (see deploy/tiers.example.toml)"
            )
    scheduler = _merge("scheduler", SchedulerConfig(), raw_scheduler)
    tiers = dict(DEFAULT_TIERS)
    raw_tiers = raw.get("tiers", {})
    if not isinstance(raw_tiers, Mapping):
        raise ConfigError("tiers: expected a table")
    given: dict[Tier, str] = {}  # tier -> the name its table was given under
    for name, body in raw_tiers.items():
        try:
            tier = Tier.parse(name)
        except ValueError as e:
            raise ConfigError(f"tiers.{name}: {e}") from None
        if tier in given:
            raise ConfigError(f"tiers.{name}: tier {tier.name} is given twice (also as tiers.{given[tier]})")
        given[tier] = name
        if not isinstance(body, Mapping):
            raise ConfigError(f"tiers.{name}: expected a table")
        tiers[tier] = _merge(f"tiers.{tier.name}", tiers[tier], body)
    options = _parse_policy_options(raw.get("policy", {}))
    config = EngineConfig(scheduler=scheduler, tiers=tiers, policy_options=options)
    return validate(config, tiers_may_be_off=tiers_may_be_off)


def load_raw(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such config file") from None
    except IsADirectoryError:
        raise ConfigError(f"{p}: a folder, not a config file") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot be read ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: invalid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text (byte {e.start}: {e.reason})") from None


def load_config(path: str | Path) -> EngineConfig:
    return parse_config(load_raw(path))
