"""The engine's per-step limits, the same for every policy in a benchmark run.

Named settings: `vllm-a100` is vLLM V1's default for an API server on an A100
(`max_num_batched_tokens` 2048, `max_num_seqs` 256); `article` is the source article's
8192 / 512. Either may be overridden field by field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from tierserve.config import EngineConfig


@dataclass(frozen=True)
class EngineLimits:
    name: str
    max_num_batched_tokens: int
    max_num_seqs: int

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError(f"engine limits {self.name}: both limits must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # vLLM refuses the same (vllm/config/scheduler.py): a step must have a token for
            # every running sequence, or a full batch could never decode.
            raise ValueError(
                f"engine limits {self.name}: max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_num_seqs ({self.max_num_seqs}), as vLLM requires"
            )

    def apply(self, config: EngineConfig) -> EngineConfig:
        scheduler = replace(
            config.scheduler,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
        )
        return replace(config, scheduler=scheduler)

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
        }

    def label(self) -> str:
        return f"{self.name} ({self.max_num_batched_tokens} batched tokens, {self.max_num_seqs} sequences)"


NAMED_LIMITS: Mapping[str, EngineLimits] = {
    "vllm-a100": EngineLimits("vllm-a100", 2048, 256),
    "article": EngineLimits("article", 8192, 512),
}
DEFAULT_LIMITS = "vllm-a100"


def engine_limits(
    name: str = DEFAULT_LIMITS, max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None
) -> EngineLimits:
    """The named setting, with any field given overriding it (the name then says so)."""
    try:
        limits = NAMED_LIMITS[name]
    except KeyError:
        raise ValueError(f"unknown engine limits {name!r}; choose from {', '.join(NAMED_LIMITS)}") from None
    changed = {
        k: v
        for k, v in (("max_num_batched_tokens", max_num_batched_tokens), ("max_num_seqs", max_num_seqs))
        if v is not None and v != getattr(limits, k)
    }
    return replace(limits, name=f"{name}+overrides", **changed) if changed else limits
