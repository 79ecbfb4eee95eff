"""The synthetic mixed-tier workload: an endless, repeatable stream of request specs."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping

import numpy as np

from tierserve.tiers import ALL_TIERS, Tier
from tierserve.workloads.conversations import ConversationPool
from tierserve.workloads.lengths import DEFAULT_SHAPES, TENANT_PREFIX, TierShape
from tierserve.workloads.spec import RequestSpec, TierMix, cap_lengths
from tierserve.workloads.tokens import random_ids


class _TierSource:
    """Requests of one tier, from the tier's own random stream (so tiers do not perturb each other)."""

    def __init__(self, tier: Tier, shape: TierShape, rng: np.random.Generator) -> None:
        self._tier = tier
        self._shape = shape
        self._rng = rng
        self._tenants = [f"{TENANT_PREFIX[tier]}-{k}" for k in range(shape.num_tenants)]
        self._prefixes = [random_ids(rng, shape.num_prefix_tokens) for _ in self._tenants]
        self._pool = None
        if shape.conversation is not None:
            self._pool = ConversationPool(shape.conversation, shape.output, rng, self._draw_tenant)

    def _draw_tenant(self, rng: np.random.Generator) -> tuple[str, tuple[int, ...]]:
        k = int(rng.integers(len(self._tenants)))
        return self._tenants[k], self._prefixes[k]

    def next(self, index: int, max_model_len: int) -> RequestSpec:
        if self._pool is not None:
            turn = self._pool.next_turn()
            num_prompt, num_output = cap_lengths(len(turn.prompt_token_ids), turn.max_tokens, max_model_len)
            return RequestSpec(
                index,
                self._tier,
                turn.tenant,
                turn.prompt_token_ids[:num_prompt],
                num_output,
                conversation_id=turn.conversation_id,
                num_history_tokens=min(turn.num_history_tokens, num_prompt),
            )
        tenant, prefix = self._draw_tenant(self._rng)
        num_body = self._shape.prompt.sample(self._rng)
        num_prompt, num_output = cap_lengths(
            len(prefix) + num_body, self._shape.output.sample(self._rng), max_model_len
        )
        prompt = (prefix + random_ids(self._rng, num_body))[:num_prompt]
        return RequestSpec(index, self._tier, tenant, prompt, num_output)


def synthetic_stream(
    seed: int,
    max_model_len: int,
    mix: TierMix | None = None,
    shapes: Mapping[Tier, TierShape] = DEFAULT_SHAPES,
) -> Iterator[RequestSpec]:
    """Endless specs: tier drawn from `mix`, then a request of that tier's shape.

    The same seed gives the same stream. Arrival times are not set (closed loop);
    `with_arrivals` adds them for an open-loop run.
    """
    mix = mix or TierMix()
    tier_seed, *shape_seeds = np.random.SeedSequence(seed).spawn(1 + len(ALL_TIERS))
    tier_rng = np.random.default_rng(tier_seed)
    sources = {
        t: _TierSource(t, shapes[t], np.random.default_rng(s))
        for t, s in zip(ALL_TIERS, shape_seeds, strict=True)
    }
    for index in itertools.count():
        yield sources[mix.draw(tier_rng)].next(index, max_model_len)
