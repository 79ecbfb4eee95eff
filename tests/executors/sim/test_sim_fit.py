from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from tierserve.executors.sim.fit import (
    benchmark_gpu_s,
    fit_all_reduce,
    fit_linear,
    fit_step_costs,
    predict_linear,
)
from tierserve.executors.sim.gpus import H200, get_gpu
from tierserve.executors.sim.nelder_mead import nelder_mead
from tierserve.executors.sim.vidur_data import GPU_DIRS, load_all_reduce, load_linear


def test_nelder_mead_finds_the_minimum_of_a_bowl() -> None:
    best = nelder_mead(lambda x: (x[0] - 3) ** 2 + 10 * (x[1] + 1) ** 2, [0.0, 0.0], [1.0, 1.0])
    assert best == pytest.approx([3, -1], abs=1e-4)


def test_step_costs_fitted_to_vllm_benchmarks_are_the_ones_in_gpus() -> None:
    overhead, latency = fit_step_costs()
    assert overhead == pytest.approx(H200.efficiency.step_overhead_s, rel=0.02)
    assert latency == pytest.approx(H200.efficiency.allreduce_latency_s, rel=0.02)
    assert benchmark_gpu_s(H200, "llama-3.1-8b", 1) == pytest.approx(0.8334, rel=0.01)


@pytest.mark.parametrize("folder", sorted(GPU_DIRS))
def test_constants_in_gpus_are_the_fit_of_the_measurements(shared_data: Path, folder: str) -> None:
    gpu = get_gpu(GPU_DIRS[folder])
    directory = shared_data / "gpu-profiles" / folder
    points = [p for f in sorted(directory.glob("*.linear.csv")) for p in load_linear(f)]
    fitted = fit_linear(gpu, points)
    eff = gpu.efficiency
    assert fitted.compute_eff_max == pytest.approx(eff.compute_eff_max, rel=0.02)
    assert fitted.compute_eff_half_tokens == pytest.approx(eff.compute_eff_half_tokens, rel=0.05)
    assert fitted.mem_eff == pytest.approx(eff.mem_eff, rel=0.02)
    assert fitted.kernel_fixed_s == pytest.approx(eff.kernel_fixed_s, rel=0.05)
    link_eff, nccl_latency = fit_all_reduce(gpu, load_all_reduce(directory / "all_reduce.csv"))
    assert link_eff == pytest.approx(eff.link_eff, abs=0.01)
    assert nccl_latency > eff.allreduce_latency_s  # NCCL under a profiler is the upper bound
    # The fitted layer time is within 10 % of the measurement on average, at every tp.
    for tp in (1, 2, 4, 8):
        errors = [abs(predict_linear(gpu, p) / p.measured_s - 1) for p in points if p.tp == tp]
        assert statistics.fmean(errors) < 0.10
