"""Rejects malformed tier arguments in vLLM's API server, with a 400, before the engine.

vLLM runs the `validate_params` hook of every custom logits processor on each request as
it is admitted, in the API server process, and answers a `ValueError` there with HTTP 400.
Load this one next to the scheduler:

    vllm serve MODEL --scheduler-cls tierserve.integrations.vllm.TierScheduler \\
        --logits-processors tierserve.integrations.vllm:TierArgsValidator

It leaves the logits alone. vLLM 0.32 has two model runners with two logits-processor
interfaces, and checks the class against the one it runs: the newer runner ("V2", the
default on CUDA where Triton is present) and the older one (V1: the CPU build, or
`VLLM_USE_V2_MODEL_RUNNER=0`). The class implements both: under V2 it declines every
request (`add_request` returns False); under V1 it is argmax-invariant, so greedy batches
skip it.
"""

from __future__ import annotations

from tierserve.integrations.vllm.versions import check_vllm_version

VLLM_VERSION = check_vllm_version()  # before any vLLM internal is imported

from typing import TYPE_CHECKING

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate
from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor as V2LogitsProcessor

from tierserve.integrations.vllm.plugin_config import PluginConfig
from tierserve.integrations.vllm.request_tier import label_request

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# The arguments' syntax does not depend on the config (only the priority mapping does).
_SYNTAX_ONLY = PluginConfig()


class TierArgsValidator(V1LogitsProcessor, V2LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        label_request(0, sampling_params.extra_args, _SYNTAX_ONLY)  # raises TierArgsError (a ValueError)

    def __init__(self, vllm_config: VllmConfig, *runner_args: object) -> None:
        """V1 passes (device, is_pin_memory), V2 the request state; neither is needed."""

    def apply(self, logits: torch.Tensor, ctx: object = None) -> torch.Tensor:
        return logits

    # V1: the batch's changes (nothing to track), and whether greedy batches may skip it.
    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        return None

    # V2: a request entering the batch; False: this processor leaves its logits alone.
    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        return False
