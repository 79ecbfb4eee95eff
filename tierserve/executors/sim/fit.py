"""Fits the simulator's efficiency factors to measurements and reports predicted vs measured.

    python -m tierserve.executors.sim.fit [--data DIR] [--plot docs/img/sim_fit.png]

* GEMM efficiency (compute_eff_max, compute_eff_half_tokens, mem_eff, kernel_fixed_s): least
  squares of log(predicted / measured) of one layer's four linear ops, per GPU, over Vidur's
  `*.linear.csv`. Only tp 1 and 2 are fitted: Vidur times one operator over and over, so at
  tp 4-8 the smaller models' weight shards (under the 40 MB / 50 MB L2 of A100 / H100) stay in
  L2 between repetitions, which a real forward pass over all layers never sees.
* All-reduce: link efficiency from messages of 16 MB and more, latency from the median residual
  of messages of 64 KB and less (`all_reduce.csv`, NCCL, one node; an upper bound).
* Step overhead and all-reduce latency: from vLLM's nightly latency benchmark on H200 (see
  gpus.py): Llama-3.1-8B at tp 1 (no all-reduce) gives the overhead, then Llama-3.1-70B at tp 4
  gives the latency, each as the measured time minus this model's GPU time.
The results are printed; copy them into gpus.py, which must not read these files at run time.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from tierserve.data_dir import DATA_ENV
from tierserve.executors.sim.cost_model import GEMMS_PER_LAYER, CostModel, SeqChunk, gemm_s
from tierserve.executors.sim.gpus import H200, GpuEfficiency, GpuProfile, get_gpu
from tierserve.executors.sim.nelder_mead import nelder_mead
from tierserve.executors.sim.vidur_data import (
    GPU_DIRS,
    AllReducePoint,
    LinearPoint,
    default_data_dir,
    load_all_reduce,
    load_linear,
)
from tierserve.model_config import LLAMA_3_1_8B, LLAMA_3_1_70B

FIT_MAX_TP = 2
REPORT_TOKENS = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096)
# vLLM nightly latency benchmark (buildkite vllm/performance-benchmark build 9515), H200,
# batch 8, 32 prompt tokens, 128 output tokens: mean end-to-end seconds.
VLLM_LATENCY_H200 = {("llama-3.1-8b", 1): 0.833421, ("llama-3.1-70b", 4): 2.07753}


def with_efficiency(gpu: GpuProfile, **changes: float) -> GpuProfile:
    return dataclasses.replace(gpu, efficiency=dataclasses.replace(gpu.efficiency, **changes))


def linear_work(point: LinearPoint) -> tuple[float, float]:
    """(FLOPs, bytes) of the point's layer; they depend on the shapes only, not on the GPU."""
    return CostModel(H200, point.model, point.tp).linear_work(point.num_tokens)


def predict_linear(gpu: GpuProfile, point: LinearPoint, work: tuple[float, float] | None = None) -> float:
    """What `CostModel.linear_layer_s` predicts for the point on `gpu`."""
    flops, num_bytes = work or linear_work(point)
    return gemm_s(gpu, flops, num_bytes, point.num_tokens, GEMMS_PER_LAYER)


def fit_linear(gpu: GpuProfile, points: Sequence[LinearPoint]) -> GpuEfficiency:
    fitted = [(p, linear_work(p)) for p in points if p.tp <= FIT_MAX_TP]
    names = ("compute_eff_max", "compute_eff_half_tokens", "mem_eff", "kernel_fixed_s")
    scale = (1.0, 100.0, 1.0, 1e-5)  # keeps the simplex's steps comparable

    def loss(x: list[float]) -> float:
        if min(x) <= 0:
            return math.inf
        trial = with_efficiency(gpu, **{n: v * s for n, v, s in zip(names, x, scale, strict=True)})
        return statistics.fmean(math.log(predict_linear(trial, p, w) / p.measured_s) ** 2 for p, w in fitted)

    best = nelder_mead(loss, [0.8, 0.5, 0.8, 0.5], [0.1, 0.5, 0.1, 0.3])
    return dataclasses.replace(
        gpu.efficiency, **{n: v * s for n, v, s in zip(names, best, scale, strict=True)}
    )


def fit_all_reduce(gpu: GpuProfile, points: Sequence[AllReducePoint]) -> tuple[float, float]:
    """(link_eff, latency_s) of t = latency + 2(tp-1)/tp × bytes / (one-way NVLink × link_eff)."""
    big = [p for p in points if p.num_bytes >= 16 << 20]
    ring = [2 * (p.tp - 1) / p.tp * p.num_bytes for p in big]
    # Least squares through the origin after removing the small-message latency, iterated once.
    small = [p for p in points if p.num_bytes <= 64 << 10]
    latency = statistics.median(p.measured_s for p in small)
    for _ in range(3):
        slope = sum(r * (p.measured_s - latency) for r, p in zip(ring, big, strict=True)) / sum(
            r * r for r in ring
        )
        latency = statistics.median(p.measured_s - 2 * (p.tp - 1) / p.tp * p.num_bytes * slope for p in small)
    return 1 / (slope * gpu.nvlink_one_way_bytes_per_s), latency


def benchmark_gpu_s(gpu: GpuProfile, model_name: str, tp: int) -> float:
    """Predicted seconds of the vLLM latency benchmark (batch 8, 32 in, 128 out) on `gpu`."""
    model = LLAMA_3_1_8B if model_name == LLAMA_3_1_8B.name else LLAMA_3_1_70B
    cm = CostModel(gpu, model, tp)
    total = cm.step_s([SeqChunk(32, 0)] * 8)
    return total + sum(cm.decode_step_s(8, 32 + k) for k in range(127))


def fit_step_costs(gpu: GpuProfile = H200) -> tuple[float, float]:
    """(step_overhead_s, allreduce_latency_s) that make the model match vLLM's two H200 latencies.

    The 8B run uses no all-reduce, so it gives the step overhead alone; the 70B tp4 run then
    gives the latency of its 2 × 80 + 1 collectives per step.
    """
    bare = with_efficiency(gpu, step_overhead_s=0.0, allreduce_latency_s=0.0)
    num_steps = 128
    overhead = (
        VLLM_LATENCY_H200[(LLAMA_3_1_8B.name, 1)] - benchmark_gpu_s(bare, LLAMA_3_1_8B.name, 1)
    ) / num_steps
    rest = VLLM_LATENCY_H200[(LLAMA_3_1_70B.name, 4)] - benchmark_gpu_s(bare, LLAMA_3_1_70B.name, 4)
    latency = (rest - num_steps * overhead) / (num_steps * (2 * LLAMA_3_1_70B.num_hidden_layers + 1))
    return overhead, latency


def report_table(gpu: GpuProfile, points: Sequence[LinearPoint]) -> str:
    """Markdown: predicted / measured ms per layer, by num_tokens (rows) and tp (columns)."""
    lines = []
    for source in sorted({p.source for p in points}):
        by_key = {(p.num_tokens, p.tp): p for p in points if p.source == source}
        tps = sorted({tp for _, tp in by_key})
        lines += [
            f"\n**{gpu.name}, {source}** — ms per layer, predicted / measured\n",
            "| tokens | " + " | ".join(f"tp {tp}" for tp in tps) + " |",
            "| ---: |" + " ---: |" * len(tps),
        ]
        for n in REPORT_TOKENS:
            cells = []
            for tp in tps:
                p = by_key.get((n, tp))
                cells.append(
                    "—" if p is None else f"{predict_linear(gpu, p) * 1e3:.3f} / {p.measured_s * 1e3:.3f}"
                )
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        errs = {
            tp: [abs(predict_linear(gpu, p) / p.measured_s - 1) for p in by_key.values() if p.tp == tp]
            for tp in tps
        }
        lines.append(
            "| mean abs error, all points | "
            + " | ".join(f"{100 * statistics.fmean(e):.1f} %" for e in errs.values())
            + " |"
        )
    return "\n".join(lines)


def plot(fits: dict[str, tuple[GpuProfile, list[LinearPoint]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(gpu, src, pts) for gpu, pts in fits.values() for src in sorted({p.source for p in pts})]
    ncols = 2
    nrows = (len(panels) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 4 * nrows), squeeze=False)
    for ax, (gpu, src, pts) in zip(axes.flat, panels, strict=False):
        for tp, colour in zip((1, 2, 4, 8), ("C0", "C1", "C2", "C3"), strict=True):
            sel = sorted((p for p in pts if p.source == src and p.tp == tp), key=lambda p: p.num_tokens)
            ax.loglog(
                [p.num_tokens for p in sel],
                [p.measured_s * 1e3 for p in sel],
                ".",
                ms=3,
                color=colour,
                label=f"measured tp{tp}",
            )
            ax.loglog(
                [p.num_tokens for p in sel], [predict_linear(gpu, p) * 1e3 for p in sel], "-", color=colour
            )
        ax.set_title(f"{gpu.name}: {src.removesuffix('.linear.csv')}", fontsize=9)
        ax.set_xlabel("tokens in step")
        ax.set_ylabel("linear ops per layer (ms)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--data",
        type=Path,
        default=default_data_dir(),
        help="the gpu-profiles folder (default: gpu-profiles/ in $TIERSERVE_DATA or shared/data beside "
        "the repository; docs/data.md)",
    )
    parser.add_argument("--plot", type=Path, help="write a predicted-vs-measured PNG here")
    args = parser.parse_args(argv)
    if args.data is None or not args.data.is_dir():
        parser.error(f"no gpu-profiles folder found; pass --data or set {DATA_ENV} (docs/data.md)")
    fits: dict[str, tuple[GpuProfile, list[LinearPoint]]] = {}
    for folder, gpu_name in GPU_DIRS.items():
        gpu = get_gpu(gpu_name)
        points = [p for f in sorted((args.data / folder).glob("*.linear.csv")) for p in load_linear(f)]
        eff = fit_linear(gpu, points)
        link_eff, latency = fit_all_reduce(gpu, load_all_reduce(args.data / folder / "all_reduce.csv"))
        print(
            f"{gpu_name}: compute_eff_max={eff.compute_eff_max:.3f} "
            f"compute_eff_half_tokens={eff.compute_eff_half_tokens:.1f} mem_eff={eff.mem_eff:.3f} "
            f"kernel_fixed_s={eff.kernel_fixed_s:.2e} link_eff={link_eff:.2f} "
            f"(NCCL all-reduce latency, an upper bound: {latency:.2e} s)"
        )
        fits[folder] = (gpu, points)  # the report uses the constants in gpus.py, as the simulator does
    overhead, latency = fit_step_costs()
    print(
        f"all GPUs: step_overhead_s={overhead:.2e} allreduce_latency_s={latency:.2e} (vLLM H200 benchmarks)"
    )
    for (name, tp), measured in VLLM_LATENCY_H200.items():
        predicted = benchmark_gpu_s(H200, name, tp)
        print(f"vLLM latency benchmark, {name} tp{tp} H200: ", end="")
        print(f"predicted {predicted:.3f} s, measured {measured:.3f} s")
    for gpu, points in fits.values():
        print(report_table(gpu, points))
    if args.plot:
        plot(fits, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
