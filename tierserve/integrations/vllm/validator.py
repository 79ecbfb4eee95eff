"""Rejects malformed tier arguments in vLLM's API server, with a 400, before the engine.

vLLM runs the `validate_params` hook of every custom logits processor on each request as
it is admitted, in the API server process, and answers a `ValueError` there with HTTP 400.
Load this one next to the scheduler:

    vllm serve MODEL --scheduler-cls tierserve.integrations.vllm.TierScheduler \\
        --logits-processors tierserve.integrations.vllm:TierArgsValidator

It leaves the logits alone (it is argmax-invariant, so vLLM skips it for greedy batches).
"""

from __future__ import annotations

from tierserve.integrations.vllm.versions import check_vllm_version

VLLM_VERSION = check_vllm_version()  # before any vLLM internal is imported

from typing import TYPE_CHECKING

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from tierserve.integrations.vllm.plugin_config import PluginConfig
from tierserve.integrations.vllm.request_tier import label_request

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# The arguments' syntax does not depend on the config (only the priority mapping does).
_SYNTAX_ONLY = PluginConfig()


class TierArgsValidator(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        label_request(0, sampling_params.extra_args, _SYNTAX_ONLY)  # raises TierArgsError (a ValueError)

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        return None
