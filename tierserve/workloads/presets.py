"""The benchmark's named workloads: the model and GPUs they run on, and their traffic.

- `default`: Llama-3.1-70B on 8 x A100-80GB, the mixed-tier traffic of `DEFAULT_SHAPES`.
- `memory-pressure`: the same model on 4 x A100-80GB (about 477k tokens of KV cache, 35 %
  of the 8-GPU set-up's) with long batch and background outputs, so that at the higher
  loads the running requests outgrow the cache: floors, borrowing, reclaim and
  swap-versus-recompute then decide who waits.
- `mooncake`, `azure-code`: the public traces replayed at their own timestamps (tiers drawn
  from the mix), on the `default` hardware. Not used to shape anything: a check on traffic
  the benchmark was not built around.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tierserve.tiers import Tier
from tierserve.workloads.lengths import DEFAULT_SHAPES, TierShape, lognormal, uniform
from tierserve.workloads.traces import in_data_folder, trace_suffix


@dataclass(frozen=True)
class WorkloadPreset:
    name: str
    model: str
    gpu: str
    tp: int
    description: str
    shapes: Mapping[Tier, TierShape] | None = None  # synthetic traffic
    trace_file: str | None = None  # a file under the shared data folder instead


MEMORY_PRESSURE_SHAPES: Mapping[Tier, TierShape] = {
    Tier.P0: DEFAULT_SHAPES[Tier.P0],
    Tier.P1: DEFAULT_SHAPES[Tier.P1],
    # P2 batch rewriting / extraction over long documents: long prompts, long answers.
    Tier.P2: TierShape(
        prompt=lognormal(1500, 0.5, 500 - 256, 4000 - 256),
        output=uniform(500, 3000),
        num_tenants=2,
        num_prefix_tokens=256,
    ),
    # P3 background generation with long contexts (distillation, export).
    Tier.P3: TierShape(prompt=uniform(1000, 4000), output=uniform(2000, 6000), num_tenants=1),
}

PRESETS: Mapping[str, WorkloadPreset] = {
    "default": WorkloadPreset(
        "default", "llama-3.1-70b", "a100-80gb", 8, "mixed-tier synthetic traffic", DEFAULT_SHAPES
    ),
    "memory-pressure": WorkloadPreset(
        "memory-pressure",
        "llama-3.1-70b",
        "a100-80gb",
        4,
        "mixed-tier traffic with long batch (P2) and background (P3) outputs on 4 GPUs",
        MEMORY_PRESSURE_SHAPES,
    ),
    "mooncake": WorkloadPreset(
        "mooncake",
        "llama-3.1-70b",
        "a100-80gb",
        8,
        "Mooncake conversation trace at its own timestamps",
        trace_file="mooncake_conversation_trace.jsonl",
    ),
    "azure-code": WorkloadPreset(
        "azure-code",
        "llama-3.1-70b",
        "a100-80gb",
        8,
        "Azure LLM inference trace (code) at its own timestamps",
        trace_file="AzureLLMInferenceTrace_code.csv",
    ),
}


def get_preset(name: str) -> WorkloadPreset:
    """A named workload, or a trace file (by its path) replayed on the `default` hardware."""
    preset = PRESETS.get(name)
    if preset is not None:
        return preset
    path = Path(name)
    if path.exists() or trace_suffix(path) is not None or path.parent != Path("."):
        # As `load_trace` says it (a file here of another suffix was an "unknown workload").
        if path.is_dir():
            raise ValueError(f"{name}: a folder, not a trace file")
        if not path.exists():
            raise ValueError(f"{name}: no such trace file{in_data_folder(path)}")
        if not path.is_file():
            raise ValueError(f"{name}: not a regular file (a trace is read from a file)")
        if trace_suffix(path) is None:
            raise ValueError(
                f"{name}: unknown trace format (expected .csv, or .jsonl / .json lines; either may be .gz)"
            )
        base = PRESETS["default"]
        description = f"{path.name} at its own timestamps"
        return WorkloadPreset(
            name, base.model, base.gpu, base.tp, description, trace_file=str(path.resolve())
        )
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(PRESETS)} or give a trace file")
