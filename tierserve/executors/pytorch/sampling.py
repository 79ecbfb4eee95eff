"""Token sampling: greedy, temperature, top-k, top-p, presence, frequency and repetition
penalties — stateless and reproducible.

The random draw for a request's k-th output token uses a generator seeded from
(seed, k) alone, so a request preempted by recompute makes the same draws again: the
same tokens while its logits agree, which batching, chunking and recompute change by
rounding (half precision most: docs/torch-executor.md).
A request without a seed gets one derived from its id and the sampler's salt.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tierserve.request import SamplingParams

_MASK64 = (1 << 64) - 1
# Below this temperature a request is sampled greedily (vLLM's threshold too): dividing
# float32 logits by less than ~1e-38 overflows to inf, and the draw would fail for the
# whole step, so for every request in it.
GREEDY_BELOW_TEMPERATURE = 1e-5


def mix_seed(seed: int, index: int) -> int:
    """A 63-bit generator seed from a request seed and an output-token index (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled float32 logits of one row, with top-k/top-p exclusions set to -inf."""
    scaled = logits.to(torch.float32) / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p; the first token always stays.
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= params.top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def apply_penalties(
    logits: torch.Tensor,
    params: SamplingParams,
    output_token_ids: Sequence[int],
    prompt_token_ids: Sequence[int] | torch.Tensor = (),
) -> torch.Tensor:
    """One row of logits, in float32, with the repetition penalty applied to every token of
    the prompt and of the output so far (transformers' and vLLM's: a positive logit divided
    by it, a negative one multiplied), then OpenAI's presence and frequency penalties
    subtracted for the tokens generated so far (not the prompt's)."""
    values = logits.to(torch.float32)
    if params.repetition_penalty != 1.0:
        outputs = torch.tensor(output_token_ids, dtype=torch.long, device=logits.device)
        prompt = torch.as_tensor(prompt_token_ids, dtype=torch.long, device=logits.device)
        seen = torch.cat((prompt, outputs))  # a token in both is written twice, the same value
        picked = values[seen]
        penalty = params.repetition_penalty
        values = values.index_put((seen,), torch.where(picked > 0, picked / penalty, picked * penalty))
    if not output_token_ids or (params.presence_penalty == 0.0 and params.frequency_penalty == 0.0):
        return values
    ids = torch.tensor(output_token_ids, dtype=torch.long, device=logits.device)
    counts = torch.bincount(ids, minlength=logits.shape[-1]).to(torch.float32)
    return values - (params.frequency_penalty * counts + params.presence_penalty * (counts > 0))


@dataclass(frozen=True, slots=True)
class SampleRequest:
    request_id: str
    params: SamplingParams
    output_index: int  # how many tokens the request had generated before this one
    output_token_ids: Sequence[int] = ()  # those tokens; needed only when `params.penalized`
    prompt_token_ids: Sequence[int] = ()  # needed only for a repetition penalty


# Prompts kept as tensors for the repetition penalty, in tokens: a 32k-token prompt made into
# a tensor again at every step took 2 ms a request.
MAX_KEPT_PROMPT_TOKENS = 1 << 21


class Sampler:
    def __init__(self, salt: int | None = None):
        self.salt = int.from_bytes(os.urandom(8), "little") if salt is None else salt
        # request id -> (its prompt, the same ids as a tensor), least recently used first. The
        # prompt object itself is kept and compared: an id may come again with another prompt.
        self._prompts: OrderedDict[str, tuple[Sequence[int], torch.Tensor]] = OrderedDict()
        self._num_kept_tokens = 0

    def seed_for(self, req: SampleRequest) -> int:
        if req.params.seed is not None:
            return req.params.seed
        digest = hashlib.blake2b(
            req.request_id.encode(), digest_size=8, key=(self.salt & _MASK64).to_bytes(8, "little")
        )
        return int.from_bytes(digest.digest(), "little")

    def sample(self, logits: torch.Tensor, requests: list[SampleRequest]) -> list[int]:
        """One token per row of `logits` ([len(requests), vocab])."""
        tokens = torch.argmax(logits, dim=-1).tolist()
        for row, req in enumerate(requests):
            params = req.params
            draws = params.temperature >= GREEDY_BELOW_TEMPERATURE
            if draws or params.penalized:
                prompt = self._prompt_tensor(req) if params.repetition_penalty != 1.0 else ()
                values = apply_penalties(logits[row].cpu(), params, req.output_token_ids, prompt)
                tokens[row] = self._draw(values, req) if draws else int(values.argmax())
        return [int(t) for t in tokens]

    def _prompt_tensor(self, req: SampleRequest) -> torch.Tensor:
        kept = self._prompts.get(req.request_id)
        if kept is not None and kept[0] is req.prompt_token_ids:
            self._prompts.move_to_end(req.request_id)
            return kept[1]
        if kept is not None:
            self._num_kept_tokens -= len(kept[0])
        ids = torch.as_tensor(req.prompt_token_ids, dtype=torch.long)
        self._prompts[req.request_id] = (req.prompt_token_ids, ids)
        self._num_kept_tokens += len(ids)
        while self._num_kept_tokens > MAX_KEPT_PROMPT_TOKENS and len(self._prompts) > 1:
            _, (oldest, _) = self._prompts.popitem(last=False)
            self._num_kept_tokens -= len(oldest)
        return ids

    def _draw(self, logits: torch.Tensor, req: SampleRequest) -> int:
        probs = torch.softmax(filter_logits(logits, req.params), dim=-1)
        gen = torch.Generator().manual_seed(mix_seed(self.seed_for(req), req.output_index))
        return int(torch.multinomial(probs, 1, generator=gen).item())
