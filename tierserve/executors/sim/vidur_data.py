"""Reads the GPU operator times that Vidur measured (shared/data/gpu-profiles/, microsoft/vidur, MIT).

Only `fit.py` and its tests use this module; the simulator itself never reads these files.
"""

from __future__ import annotations

import csv
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from tierserve.data_dir import find_data_dir
from tierserve.model_config import ModelConfig

LINEAR_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
GPU_DIRS = {"a100": "a100-80gb", "h100": "h100-80gb"}  # folder -> simulator profile name


@dataclass(frozen=True, slots=True)
class LinearPoint:
    """Measured time of one layer's four GEMMs on one GPU of `tp`, for `num_tokens` tokens."""

    source: str  # the CSV file's name
    model: ModelConfig
    tp: int
    num_tokens: int
    measured_s: float


@dataclass(frozen=True, slots=True)
class AllReducePoint:
    tp: int
    num_bytes: int
    measured_s: float


def default_data_dir() -> Path | None:
    """gpu-profiles/ in the data folder ($TIERSERVE_DATA or shared/data beside the repository)."""
    root = find_data_dir()
    path = None if root is None else root / "gpu-profiles"
    return path if path is not None and path.is_dir() else None


def _model_from_row(name: str, row: dict[str, str]) -> ModelConfig:
    return ModelConfig(
        name=name,
        vocab_size=int(row["vocab_size"]),
        hidden_size=int(row["n_embd"]),
        intermediate_size=int(row["n_expanded_embd"]),
        num_hidden_layers=1,
        num_attention_heads=int(row["n_head"]),
        num_key_value_heads=int(row["n_kv_head"]),
        max_position_embeddings=4096,
    )


def load_linear(path: Path) -> list[LinearPoint]:
    """One point per (num_tokens, tp): the median over repeated rows of the summed op medians (ms -> s)."""
    times: dict[tuple[int, int], list[float]] = defaultdict(list)
    model: ModelConfig | None = None
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            model = model or _model_from_row(path.name.removesuffix(".linear.csv"), row)
            key = (int(row["num_tokens"]), int(row["num_tensor_parallel_workers"]))
            times[key].append(sum(float(row[f"time_stats.{op}.median"]) for op in LINEAR_OPS) / 1e3)
    if model is None:
        raise ValueError(f"{path}: no rows")
    return [
        LinearPoint(path.name, model, tp, num_tokens, statistics.median(ts))
        for (num_tokens, tp), ts in sorted(times.items())
    ]


def load_all_reduce(path: Path) -> list[AllReducePoint]:
    """NCCL all-reduce times within one node (num_workers GPUs on one machine), ms -> s."""
    points = []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            workers = int(row["num_workers"])
            if int(row["devices_per_node"]) != workers:
                continue
            points.append(
                AllReducePoint(workers, int(row["size"]), float(row["time_stats.all_reduce.median"]) / 1e3)
            )
    return points
