"""Priority tiers. P0 is the most urgent; a larger value is less urgent."""

from __future__ import annotations

from enum import IntEnum


class Tier(IntEnum):
    P0 = 0  # realtime: multi-turn chat, tool calls
    P1 = 1  # online: API chat, summarisation
    P2 = 2  # batch: data processing, classification
    P3 = 3  # background: evaluation, distillation, export

    @property
    def label(self) -> str:
        return TIER_LABELS[self]

    @classmethod
    def parse(cls, value: str | int) -> Tier:
        """Accept 0..3, "P0".."P3" or a label such as "realtime"; raise ValueError otherwise."""
        if isinstance(value, int):
            if value in cls._value2member_map_:
                return cls(value)
        else:
            text = value.strip().lower()
            for tier in cls:
                if text in (tier.name.lower(), tier.label, str(int(tier))):
                    return tier
        names = ", ".join(f"{t.name}/{t.label}" for t in cls)
        raise ValueError(f"unknown tier {value!r}; expected one of {names}")


TIER_LABELS: dict[Tier, str] = {
    Tier.P0: "realtime",
    Tier.P1: "online",
    Tier.P2: "batch",
    Tier.P3: "background",
}

ALL_TIERS: tuple[Tier, ...] = tuple(Tier)
