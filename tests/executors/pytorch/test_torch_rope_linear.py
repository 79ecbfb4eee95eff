"""Linear rope scaling (rope_type "linear", position interpolation) computes what transformers does."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import pytest
import torch
from torch_checkpoints import Checkpoint
from torch_paged_runner import greedy_paged, prompt_logits

from tierserve.executors.pytorch.executor import build_torch_executor
from tierserve.executors.pytorch.hf_config import ModelLoadError
from tierserve.executors.pytorch.loader import load_model


def test_linear_rope_scaling_matches_transformers_past_one_block(
    make_checkpoint: Callable[..., Checkpoint],
) -> None:
    ckpt = make_checkpoint(rope_scaling={"rope_type": "linear", "factor": 4.0})
    executor, _ = build_torch_executor(
        ckpt.path, dtype=torch.float64, num_device_blocks=64, num_host_blocks=4
    )
    rng = random.Random(5)
    ps = [[rng.randrange(2, 300) for _ in range(n)] for n in (5, 40, 70)]
    for p in ps:
        torch.testing.assert_close(prompt_logits(executor, p), ckpt.logits(p), atol=1e-9, rtol=1e-9)
    assert greedy_paged(executor, ps, 12, chunk=9) == [ckpt.greedy(p, 12) for p in ps]
    # The factor matters: without it the logits past the first positions differ.
    unscaled = ckpt.path / "config.json"
    config = json.loads(unscaled.read_text())
    config["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": config["rope_parameters"]["rope_theta"],
    }
    unscaled.write_text(json.dumps(config))
    plain, _ = build_torch_executor(ckpt.path, dtype=torch.float64, num_device_blocks=64, num_host_blocks=4)
    assert not torch.allclose(prompt_logits(plain, ps[1]), ckpt.logits(ps[1]), atol=1e-6)


@pytest.mark.parametrize("factor", [0, -2.0, "4", None])
def test_a_linear_rope_factor_that_is_not_a_positive_number_is_a_load_error(
    make_checkpoint: Callable[..., Checkpoint], factor: object
) -> None:
    ckpt = make_checkpoint()
    path = ckpt.path / "config.json"
    config = json.loads(path.read_text())
    config["rope_parameters"] = {"rope_type": "linear", "factor": factor, "rope_theta": 10000.0}
    path.write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"config\.json: linear rope scaling: factor"):
        load_model(ckpt.path, torch.device("cpu"))
