"""Prompt and output length distributions of each tier's traffic (docs/benchmark.md has the table)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

from tierserve.tiers import Tier


@dataclass(frozen=True)
class LengthDist:
    """A token count: lognormal (median, sigma) or uniform over [low, high], clipped to [low, high]."""

    kind: Literal["lognormal", "uniform"]
    low: int
    high: int
    median: float = 0.0  # lognormal only
    sigma: float = 0.0  # lognormal only

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"length range [{self.low}, {self.high}] is empty or below 1")
        if self.kind == "lognormal" and (self.median <= 0 or self.sigma <= 0):
            raise ValueError("a lognormal length needs median > 0 and sigma > 0")

    def sample(self, rng: np.random.Generator) -> int:
        if self.kind == "uniform":
            return int(rng.integers(self.low, self.high + 1))
        value = rng.lognormal(math.log(self.median), self.sigma)
        return int(min(self.high, max(self.low, round(value))))


def lognormal(median: float, sigma: float, low: int, high: int) -> LengthDist:
    return LengthDist("lognormal", low, high, median, sigma)


def uniform(low: int, high: int) -> LengthDist:
    return LengthDist("uniform", low, high)


@dataclass(frozen=True)
class TierShape:
    """The requests of one tier.

    A tenant's requests start with that tenant's shared prefix (a system prompt or a batch
    job's instruction) of `num_prefix_tokens`; `prompt` counts the tokens after it.
    Conversational tiers (`conversation` set) grow a prompt turn by turn instead.
    """

    prompt: LengthDist
    output: LengthDist
    num_tenants: int = 1
    num_prefix_tokens: int = 0
    conversation: ConversationShape | None = None


@dataclass(frozen=True)
class ConversationShape:
    """Multi-turn chat: turn k's prompt = turn k-1's prompt + its answer + a new user turn."""

    first_turn: LengthDist  # the first user message (after the tenant's system prompt)
    user_turn: LengthDist  # each later user message
    max_prompt_tokens: int  # a conversation that would outgrow this is replaced by a new one
    pool_size: int = 16  # conversations open at once; each turn picks one at random


DEFAULT_SHAPES: Mapping[Tier, TierShape] = {
    # P0 realtime chat: 256-token system prompt + a 750..1750-token first turn, then turns of
    # 30..400 tokens; prompts grow from ~1k to 4k. Short-to-medium answers.
    Tier.P0: TierShape(
        prompt=uniform(1, 1),  # unused: the conversation decides the prompt
        output=lognormal(120, 0.5, 50, 300),
        num_tenants=4,
        num_prefix_tokens=256,
        conversation=ConversationShape(
            first_turn=lognormal(1000, 0.3, 750, 1750),
            user_turn=lognormal(120, 0.7, 30, 400),
            max_prompt_tokens=4096,
        ),
    ),
    # P1 online API chat and summarisation.
    Tier.P1: TierShape(
        prompt=lognormal(800, 0.7, 200, 3000), output=lognormal(220, 0.4, 100, 500), num_tenants=8
    ),
    # P2 batch classification / data processing: a per-job instruction, then the item.
    Tier.P2: TierShape(
        prompt=lognormal(600, 0.5, 300 - 256, 2000 - 256),
        output=uniform(1, 32),
        num_tenants=2,
        num_prefix_tokens=256,
    ),
    # P3 background long generation (evaluation, distillation, export).
    Tier.P3: TierShape(prompt=uniform(500, 2000), output=uniform(500, 2000), num_tenants=1),
}

TENANT_PREFIX: Mapping[Tier, str] = {Tier.P0: "chat", Tier.P1: "api", Tier.P2: "batch", Tier.P3: "eval"}
