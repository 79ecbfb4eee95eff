"""What a benchmark asks the engine to do: request specs and the tier mix they are drawn from."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from tierserve.tiers import ALL_TIERS, Tier


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a workload, before it becomes an engine `Request`.

    `index` is the position in the workload stream: the same seed gives the same spec at
    the same index. `arrival_s` is set for open-loop workloads (seconds from the start)
    and ignored by closed-loop clients. A conversation turn's prompt starts with the
    previous turn's prompt and answer: its first `num_history_tokens` tokens.
    """

    index: int
    tier: Tier
    tenant: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    arrival_s: float | None = None
    conversation_id: str | None = None
    num_history_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request spec {self.index}: empty prompt")
        if self.max_tokens < 1:
            raise ValueError(f"request spec {self.index}: max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.num_history_tokens <= len(self.prompt_token_ids):
            raise ValueError(f"request spec {self.index}: history longer than the prompt")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class TierMix:
    """The share of requests in each tier; shares are normalised to sum to 1."""

    shares: Mapping[Tier, float] = field(
        default_factory=lambda: {Tier.P0: 0.05, Tier.P1: 0.60, Tier.P2: 0.30, Tier.P3: 0.05}
    )

    def __post_init__(self) -> None:
        missing = [t.name for t in ALL_TIERS if t not in self.shares]
        if missing:
            raise ValueError(f"tier mix: missing shares for {', '.join(missing)}")
        if not all(0 <= s < math.inf for s in self.shares.values()):  # written so that nan fails too
            raise ValueError("tier mix: shares must be finite numbers >= 0")
        total = sum(self.shares.values())
        if total <= 0:
            raise ValueError("tier mix: shares add up to zero")
        if total == math.inf:  # 1e308/1e308/1/1: every share normalised to 0
            raise ValueError("tier mix: shares add up past what a float holds; scale them down")
        object.__setattr__(self, "shares", {t: self.shares[t] / total for t in ALL_TIERS})

    @classmethod
    def parse(cls, text: str) -> TierMix:
        """Parse "5/60/30/5" (P0/P1/P2/P3, any positive scale)."""
        parts = text.split("/")
        if len(parts) != len(ALL_TIERS):
            raise ValueError(f"tier mix {text!r}: expected four shares like 5/60/30/5")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            raise ValueError(f"tier mix {text!r}: shares must be numbers") from None
        return cls(dict(zip(ALL_TIERS, values, strict=True)))

    def probabilities(self) -> list[float]:
        return [self.shares[t] for t in ALL_TIERS]

    def draw(self, rng: np.random.Generator) -> Tier:
        """One tier; inverse-CDF on one uniform draw (rng.choice with weights is ~100x slower)."""
        u = rng.random()
        cumulative = 0.0
        for tier in ALL_TIERS:
            cumulative += self.shares[tier]
            if u < cumulative and self.shares[tier] > 0:
                return tier
        return max(t for t in ALL_TIERS if self.shares[t] > 0)  # u within rounding of 1

    def label(self) -> str:
        return "/".join(f"{self.shares[t] * 100:g}" for t in ALL_TIERS)


def cap_lengths(num_prompt_tokens: int, num_output_tokens: int, max_model_len: int) -> tuple[int, int]:
    """Fit a request in the model context: output at most half of it, the prompt truncated to the rest.

    The prompt keeps its head, so shared prefixes stay shared. Both stay >= 1.
    """
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    num_output = max(1, min(num_output_tokens, max_model_len // 2))
    num_prompt = max(1, min(num_prompt_tokens, max_model_len - num_output))
    return num_prompt, num_output
