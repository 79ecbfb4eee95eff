"""GPU profiles for the simulator: datasheet figures plus efficiency factors fitted to measurements.

Every constant names its source. Datasheet figures are what NVIDIA publishes; efficiency
factors say how much of that a real engine gets, and were fitted by `fit.py` to the
operator times Vidur measured (`shared/data/gpu-profiles/`, microsoft/vidur, MIT licence).
The simulator never reads those files at run time: the fitted numbers are written here.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class GpuEfficiency:
    """Fractions of datasheet peaks that inference kernels reach, and fixed costs.

    Linear layers reach `compute_eff_max * n / (n + compute_eff_half_tokens)` of peak FLOP/s
    for a step of `n` tokens (small GEMMs cannot fill the GPU), and `mem_eff` of HBM
    bandwidth. Each GEMM launch also costs `kernel_fixed_s`.
    """

    compute_eff_max: float
    compute_eff_half_tokens: float
    mem_eff: float
    kernel_fixed_s: float
    attention_eff: float  # fraction of peak FLOP/s reached by (flash) attention over the context
    link_eff: float  # ring all-reduce bus bandwidth / one-direction NVLink bandwidth
    allreduce_latency_s: float  # fixed cost of one all-reduce
    step_overhead_s: float  # CPU-side cost of one engine step (schedule, launch, sample, detokenize)

    def compute_eff(self, num_tokens: int) -> float:
        return self.compute_eff_max * num_tokens / (num_tokens + self.compute_eff_half_tokens)


@dataclass(frozen=True, slots=True)
class GpuProfile:
    """One GPU model: datasheet figures (SXM parts) and how much of them inference reaches."""

    name: str
    peak_flops: float  # dense BF16 tensor-core FLOP/s
    hbm_bytes_per_s: float
    memory_bytes: int  # device memory as CUDA reports it (what gpu_memory_utilization multiplies)
    nvlink_bytes_per_s: float  # per GPU, both directions together, as the datasheets count it
    host_link_bytes_per_s: float  # achieved pinned host<->device copy rate, one direction
    efficiency: GpuEfficiency

    @property
    def nvlink_one_way_bytes_per_s(self) -> float:
        return self.nvlink_bytes_per_s / 2


# Link efficiency: fitted by `fit.py` to the large messages (>= 16 MB) of
# shared/data/gpu-profiles/{a100,h100}/all_reduce.csv (NCCL ring, one DGX node, tp 2/4/8).
# Latency: those files put it at 32 us (A100) and 35 us (H100), but they include the
# profiler's own overhead and NCCL rather than vLLM's custom all-reduce, so they are upper
# bounds. Both the latency and the step overhead are instead fitted by `fit.py` to vLLM's
# nightly latency benchmark (buildkite vllm/performance-benchmark build 9515, H200, batch 8,
# 32 prompt / 128 output tokens): Llama-3.1-8B tp 1 took 833.4 ms (no all-reduce: gives the
# CPU overhead of a step), Llama-3.1-70B tp 4 took 2077.5 ms (then gives the latency). Both
# are host-side costs and are taken to be the same on every GPU.
STEP_OVERHEAD_S = 2.07e-3
ALLREDUCE_LATENCY_S = 22.6e-6

# Flash attention: FlashAttention-2 (Dao 2023, arXiv:2307.08691) reaches 50-73 % of peak in
# the forward pass on A100; on H100, FlashAttention-2 reaches ~35 % and FlashAttention-3
# (Shah et al. 2024, arXiv:2407.08608) up to 75 % in BF16. 0.5 sits inside both ranges.
ATTENTION_EFF = 0.5

# Source: NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): BF16 312 TFLOPS dense
# (624 with sparsity), HBM2e 2,039 GB/s, 80 GB, NVLink 600 GB/s, PCIe Gen4 64 GB/s
# (both directions). CUDA reports 79.15 GiB ("79.15 GiB total capacity" in PyTorch
# out-of-memory messages on A100-SXM4-80GB). Host copies: PCIe Gen4 x16 moves 32 GB/s
# raw per direction; pinned cudaMemcpy reaches ~25 GB/s (CUDA samples' bandwidthTest).
A100_80GB = GpuProfile(
    name="a100-80gb",
    peak_flops=312e12,
    hbm_bytes_per_s=2.039e12,
    memory_bytes=int(79.15 * GiB),
    nvlink_bytes_per_s=600e9,
    host_link_bytes_per_s=25e9,
    efficiency=GpuEfficiency(
        # Fitted by fit.py to shared/data/gpu-profiles/a100/*.linear.csv (tp 1-2).
        compute_eff_max=0.739,
        compute_eff_half_tokens=76.7,
        mem_eff=0.802,
        kernel_fixed_s=8.2e-6,
        attention_eff=ATTENTION_EFF,
        # link_eff: fitted by fit.py to shared/data/gpu-profiles/a100/all_reduce.csv.
        link_eff=0.56,
        allreduce_latency_s=ALLREDUCE_LATENCY_S,
        step_overhead_s=STEP_OVERHEAD_S,
    ),
)

# Source: NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): BF16 1,979 TFLOPS with
# sparsity = 989 dense, HBM3 3.35 TB/s, 80 GB, NVLink 900 GB/s, PCIe Gen5 128 GB/s (both
# directions). CUDA reports 79.11 GiB ("GPU 0 has a total capacity of 79.11 GiB",
# vllm-project/vllm issue 27508, H100 80GB). Host copies: PCIe Gen5 x16 moves 64 GB/s raw
# per direction; we assume the same ~78 % that Gen4 reaches with pinned memory: 50 GB/s.
H100_80GB = GpuProfile(
    name="h100-80gb",
    peak_flops=989e12,
    hbm_bytes_per_s=3.35e12,
    memory_bytes=int(79.11 * GiB),
    nvlink_bytes_per_s=900e9,
    host_link_bytes_per_s=50e9,
    efficiency=GpuEfficiency(
        # Fitted by fit.py to shared/data/gpu-profiles/h100/*.linear.csv (tp 1-2).
        compute_eff_max=0.755,
        compute_eff_half_tokens=149.2,
        mem_eff=0.918,
        kernel_fixed_s=7.4e-6,
        attention_eff=ATTENTION_EFF,
        # link_eff: fitted by fit.py to shared/data/gpu-profiles/h100/all_reduce.csv.
        link_eff=0.80,
        allreduce_latency_s=ALLREDUCE_LATENCY_S,
        step_overhead_s=STEP_OVERHEAD_S,
    ),
)

# Source: NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): BF16 1,979 TFLOPS with
# sparsity = 989 dense, HBM3e 4.8 TB/s, 141 GB, NVLink 900 GB/s, PCIe Gen5 128 GB/s.
# CUDA reports 139.80 GiB ("GPU 0 has a total capacity of 139.80 GiB" in PyTorch
# out-of-memory messages on H200). The H200 is the H100's GH100 chip with faster, larger
# memory, and no measurements of it are in shared/data: it reuses the H100's efficiencies.
H200 = GpuProfile(
    name="h200",
    peak_flops=989e12,
    hbm_bytes_per_s=4.8e12,
    memory_bytes=int(139.80 * GiB),
    nvlink_bytes_per_s=900e9,
    host_link_bytes_per_s=50e9,
    efficiency=H100_80GB.efficiency,
)

KNOWN_GPUS: dict[str, GpuProfile] = {g.name: g for g in (A100_80GB, H100_80GB, H200)}


def get_gpu(name: str) -> GpuProfile:
    """The profile called `name` (case-insensitive), or the one whose name it begins before a
    '-' ("a100" for a100-80gb: the README names them A100, H100, H200); ValueError listing
    the known ones if none is."""
    key = name.lower()
    gpu = KNOWN_GPUS.get(key)
    if gpu is None:
        family = [g for known, g in KNOWN_GPUS.items() if known.split("-")[0] == key]
        gpu = family[0] if len(family) == 1 else None
    if gpu is None:
        raise ValueError(f"unknown GPU {name!r}; known GPUs: {', '.join(sorted(KNOWN_GPUS))}")
    return gpu
