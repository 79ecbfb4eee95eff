"""`TierArgsValidator` as each of vLLM 0.32's model runners loads it (needs vLLM).

vLLM's GPU build runs the newer model runner (V2) by default and refuses a logits processor
that is not a V2 one at start-up; the CPU build runs V1. Both loaders are vLLM's own.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import _load_logitsprocs_by_fqcns, validate_logits_processors_parameters
from vllm.v1.worker.gpu.sample.logits_processor import build_custom_logits_processors_params_validator
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor as V2LogitsProcessor

from tierserve.integrations.vllm import TierArgsValidator

FQCN = "tierserve.integrations.vllm:TierArgsValidator"
GOOD: dict[str, Any] = {"tier": "realtime", "tenant": "acme"}
BAD: dict[str, Any] = {"tier": "P9"}


def test_the_v2_runner_loads_it_and_its_check_refuses_a_bad_tier() -> None:
    validate = build_custom_logits_processors_params_validator([FQCN])  # raised ValueError before
    validate(SamplingParams(extra_args=GOOD))
    validate(SamplingParams())
    with pytest.raises(VLLMValidationError, match="unknown tier 'P9'"):  # vLLM's 400
        validate(SamplingParams(extra_args=BAD))


def test_the_v1_runner_loads_it_and_its_check_refuses_a_bad_tier() -> None:
    assert _load_logitsprocs_by_fqcns([FQCN]) == [TierArgsValidator]
    validate_logits_processors_parameters([FQCN], SamplingParams(extra_args=GOOD))
    with pytest.raises(VLLMValidationError, match="unknown tier 'P9'"):
        validate_logits_processors_parameters([FQCN], SamplingParams(extra_args=BAD))


def test_it_leaves_the_logits_alone_under_either_runner() -> None:
    logits = torch.randn(3, 11)
    v2 = TierArgsValidator(None, object())  # type: ignore[arg-type]  # V2: (vllm_config, req_states)
    assert isinstance(v2, V2LogitsProcessor)
    assert v2.add_request(0, SamplingParams(extra_args=GOOD)) is False  # it modifies no request's logits
    assert v2.apply(logits, object()) is logits
    v1 = TierArgsValidator(None, torch.device("cpu"), False)  # type: ignore[arg-type]  # V1
    assert v1.is_argmax_invariant() and v1.apply(logits) is logits
