"""The `sim` executor: a first-principles cost model of real GPUs (see docs/simulator.md)."""

from tierserve.executors.sim.cost_model import CostModel, SeqChunk, StepCost
from tierserve.executors.sim.executor import SimExecutor, build_sim_executor, get_model
from tierserve.executors.sim.gpus import KNOWN_GPUS, GpuEfficiency, GpuProfile, get_gpu

__all__ = [
    "KNOWN_GPUS",
    "CostModel",
    "GpuEfficiency",
    "GpuProfile",
    "SeqChunk",
    "SimExecutor",
    "StepCost",
    "build_sim_executor",
    "get_gpu",
    "get_model",
]
