"""The step workspace hands out reused memory; the rotary rewrite computes what it did."""

from __future__ import annotations

import torch

from tierserve.executors.pytorch.rope import RotaryEmbedding, apply_rotary
from tierserve.executors.pytorch.workspace import Workspace

CPU = torch.device("cpu")


def test_take_reuses_a_name_s_memory_and_grows_when_asked_for_more() -> None:
    ws = Workspace()
    a = ws.take("x", (4, 8), torch.float32, CPU)
    b = ws.take("x", (2, 8), torch.float32, CPU)
    assert b.data_ptr() == a.data_ptr() and b.shape == (2, 8) and b.is_contiguous()
    other = ws.take("y", (4, 8), torch.float32, CPU)
    assert other.data_ptr() != a.data_ptr()  # each name has its own buffer
    bigger = ws.take("x", (16, 8), torch.float32, CPU)
    assert bigger.shape == (16, 8) and bigger.data_ptr() != a.data_ptr()
    assert ws.take("x", (4, 8), torch.float64, CPU).dtype == torch.float64


def test_gather_is_index_select() -> None:
    ws = Workspace()
    rows = torch.randn(10, 3)
    for index in (torch.tensor([3, 1, 3]), torch.tensor([9, 0, 5, 5, 2, 7])):
        torch.testing.assert_close(ws.gather("k", rows, index), rows.index_select(0, index), rtol=0, atol=0)


def test_apply_rotary_equals_the_rotate_half_formula_bit_for_bit() -> None:
    torch.manual_seed(0)
    rope = RotaryEmbedding(16, 10000.0, None, CPU)
    cos, sin = rope.cos_sin(torch.arange(7) * 13, torch.float32)
    qkv = torch.randn(7, 5, 16)
    x = qkv[:, :3]  # a non-contiguous view, as the model passes it
    half = x.shape[-1] // 2
    expected = x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
    torch.testing.assert_close(apply_rotary(x, cos, sin), expected, rtol=0, atol=0)
